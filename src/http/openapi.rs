//! The OpenAPI document, built from the handlers' own annotations so it describes what exists.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;

use super::state::AppState;
use super::{
    attachments, audit, deliveries, downloads, exports, feeds, health, records, schemas, sharing, usage, webhooks,
};

#[derive(OpenApi)]
#[openapi(
    info(title = "exportd", version = "1", description = "Multi-tenant exports and incremental feeds. See docs/contract.md."),
    modifiers(&BearerAuth)
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).bearer_format("JWT").build()),
        );
    }
}

pub fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(health::router())
        .merge(records::router())
        .merge(exports::router())
        .merge(downloads::router())
        .merge(attachments::router())
        .merge(audit::router())
        .merge(feeds::router())
        .merge(schemas::router())
        .merge(usage::router())
        .merge(webhooks::router())
        .merge(deliveries::router())
        .merge(sharing::router())
        .merge(sharing::profile_router())
}

/// Adds what every operation can answer besides its own statuses, so the document lists every
/// status a client can meet: problems for a missing or bad token (401), the rate limits (429)
/// and an unreachable database or store (503) on authenticated operations; a bad parameter or
/// body (400), and for bodies a wrong media type (415) or size (413). Declared once here
/// rather than on each handler, where one would be forgotten.
pub fn add_common_responses(doc: &mut utoipa::openapi::OpenApi) {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    let components = doc.components.get_or_insert_with(Default::default);
    let text = || ObjectBuilder::new().schema_type(Type::String);
    let problem = ObjectBuilder::new()
        .description(Some("RFC 9457 problem details; `code` is stable, `field` names the offending input"))
        .property("type", text())
        .property("title", text())
        .property("status", ObjectBuilder::new().schema_type(Type::Integer))
        .property("code", text())
        .property("detail", text())
        .property("field", text())
        .required("type")
        .required("status")
        .required("code");
    components.schemas.insert("Problem".to_owned(), problem.into());
    let sharing_error = ObjectBuilder::new()
        .description(Some("Delta Sharing's error body (the /delta-sharing routes)"))
        .property("errorCode", text())
        .property("message", text())
        .required("errorCode")
        .required("message");
    components.schemas.insert("SharingError".to_owned(), sharing_error.into());
    let sharing_paths: Vec<String> =
        doc.paths.paths.keys().filter(|path| path.starts_with(sharing::PREFIX)).cloned().collect();
    for (path, operation) in operations_by_path_mut(doc) {
        let error = if sharing_paths.contains(path) { ErrorBody::Sharing } else { ErrorBody::Problem };
        let authenticated = operation.security.as_ref().is_some_and(|s| !s.is_empty());
        let takes_input = operation.parameters.as_ref().is_some_and(|p| !p.is_empty());
        let has_body = operation.request_body.is_some();
        // Downloads authenticate with a signed link instead of a bearer token; only
        // `/healthz` (no input, no token) is outside the limits.
        let limited = authenticated || takes_input;
        let common = [
            (authenticated, "401", "missing, malformed, expired or revoked bearer token"),
            (limited, "429", "over a rate or concurrency limit; `Retry-After` says when to try again"),
            (limited, "503", "the database or object store is unreachable; nothing changed; `Retry-After`"),
            (takes_input || has_body, "400", "an invalid parameter or body; `field` names it"),
            (has_body, "413", "the body is larger than the server accepts"),
            (has_body, "415", "the body is not `application/json`"),
        ];
        for (applies, status, description) in common {
            if applies {
                operation.responses.responses.entry(status.to_owned()).or_insert_with(|| error.response(description));
            }
        }
    }
}

/// Links from a response to the operations its values feed (OpenAPI `links`), so a client or a
/// stateful tester can follow create → status → manifest → file, and cursor → next page.
pub fn add_links(doc: &mut utoipa::openapi::OpenApi) {
    const EXPORT_ID: (&str, &str) = ("id", "$response.body#/id");
    const SAME_EXPORT: (&str, &str) = ("id", "$request.path.id");
    const SAME_DATASET: (&str, &str) = ("dataset", "$request.path.dataset");
    const NEXT_PAGE: (&str, &str) = ("cursor", "$response.body#/next_cursor");
    const CREATED: &[&str] = &["200", "202"];
    const OK: &[&str] = &["200"];
    let links = [
        OperationLink {
            from: "create_export",
            statuses: CREATED,
            name: "status",
            to: "get_export",
            parameters: &[EXPORT_ID],
        },
        OperationLink {
            from: "create_export",
            statuses: CREATED,
            name: "manifest",
            to: "get_manifest",
            parameters: &[EXPORT_ID],
        },
        OperationLink {
            from: "create_export",
            statuses: CREATED,
            name: "file",
            to: "download_file",
            parameters: &[EXPORT_ID],
        },
        OperationLink {
            from: "create_export",
            statuses: CREATED,
            name: "cancel",
            to: "cancel_export",
            parameters: &[EXPORT_ID],
        },
        OperationLink {
            from: "create_export",
            statuses: CREATED,
            name: "revoke",
            to: "revoke_export",
            parameters: &[EXPORT_ID],
        },
        OperationLink {
            from: "get_export",
            statuses: OK,
            name: "manifest",
            to: "get_manifest",
            parameters: &[SAME_EXPORT],
        },
        OperationLink {
            from: "get_export",
            statuses: OK,
            name: "file",
            to: "download_file",
            parameters: &[SAME_EXPORT],
        },
        OperationLink {
            from: "get_export",
            statuses: OK,
            name: "first_shard",
            to: "download_shard",
            parameters: &[SAME_EXPORT, ("n", "0")],
        },
        OperationLink {
            from: "list_exports",
            statuses: OK,
            name: "next_page",
            to: "list_exports",
            parameters: &[NEXT_PAGE],
        },
        OperationLink { from: "audit_log", statuses: OK, name: "next_page", to: "audit_log", parameters: &[NEXT_PAGE] },
        OperationLink {
            from: "changes",
            statuses: OK,
            name: "next_page",
            to: "changes",
            parameters: &[SAME_DATASET, NEXT_PAGE],
        },
        OperationLink {
            from: "current_cursor",
            statuses: OK,
            name: "changes",
            to: "changes",
            parameters: &[SAME_DATASET, ("cursor", "$response.body#/cursor")],
        },
    ];
    for operation in operations_mut(doc) {
        let Some(id) = operation.operation_id.clone() else { continue };
        for link in links.iter().filter(|link| link.from == id) {
            for status in link.statuses {
                let Some(utoipa::openapi::RefOr::T(response)) = operation.responses.responses.get_mut(*status) else {
                    panic!("{} declares no {status} response to link from", link.from);
                };
                let built = link
                    .parameters
                    .iter()
                    .fold(utoipa::openapi::link::LinkBuilder::new().operation_id(link.to), |built, (k, v)| {
                        built.parameter(*k, *v)
                    });
                response.links.insert(link.name.to_owned(), built.build().into());
            }
        }
    }
}

/// A response's value feeding another operation's parameters (`name: value expression`).
struct OperationLink {
    from: &'static str,
    statuses: &'static [&'static str],
    name: &'static str,
    to: &'static str,
    parameters: &'static [(&'static str, &'static str)],
}

/// Every operation of the document.
fn operations_mut(doc: &mut utoipa::openapi::OpenApi) -> impl Iterator<Item = &mut utoipa::openapi::path::Operation> {
    operations_by_path_mut(doc).map(|(_, operation)| operation)
}

/// Every operation of the document, with its path.
fn operations_by_path_mut(
    doc: &mut utoipa::openapi::OpenApi,
) -> impl Iterator<Item = (&String, &mut utoipa::openapi::path::Operation)> {
    doc.paths.paths.iter_mut().flat_map(|(path, item)| {
        [&mut item.get, &mut item.post, &mut item.put, &mut item.delete, &mut item.head, &mut item.patch]
            .into_iter()
            .flatten()
            .map(move |operation| (path, operation))
    })
}

/// How an operation's errors look: problem+json, or Delta Sharing's `{errorCode, message}`.
#[derive(Clone, Copy)]
enum ErrorBody {
    Problem,
    Sharing,
}

impl ErrorBody {
    fn response(self, description: &str) -> utoipa::openapi::RefOr<utoipa::openapi::Response> {
        use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
        let (schema, media_type) = match self {
            ErrorBody::Problem => ("Problem", "application/problem+json"),
            ErrorBody::Sharing => ("SharingError", "application/json"),
        };
        let content = ContentBuilder::new().schema(Some(Ref::from_schema_name(schema))).build();
        ResponseBuilder::new().description(description).content(media_type, content).build().into()
    }
}
