//! The OpenAPI document, built from the handlers' own annotations so it describes what exists.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;

use super::state::AppState;
use super::{audit, downloads, exports, feeds, health, records, usage};

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
        .merge(audit::router())
        .merge(feeds::router())
        .merge(usage::router())
}
