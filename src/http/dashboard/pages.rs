//! The dashboard's pages as maud templates (compile-time checked, every interpolation escaped).

use maud::{DOCTYPE, Markup, PreEscaped, html};
use time::OffsetDateTime;

use super::charts::{BarChart, Series};
use super::units::{self, Quantity, bytes, count, duration, relative};
use crate::audit::AuditEntry;
use crate::delivery::store::Lag;
use crate::exports::{ExportJob, ShardRecord};
use crate::quota::RefusalKind;
use crate::served::ServedView;
use crate::tenants::Tenant;
use crate::usage::Usage;
use crate::usage::history::Point;
use crate::usage::partners::PartnerActivity;

const STYLE: &str = "body{font:14px/1.45 system-ui,sans-serif;margin:2em;color:#1f2328;max-width:1100px}\
    h1{font-size:22px}h2{font-size:17px;margin-top:1.8em}a{color:#0550ae}\
    table{border-collapse:collapse;margin:.4em 0}td,th{padding:4px 10px;border-bottom:1px solid #d0d7de;text-align:left}\
    meter{width:260px;height:14px;vertical-align:middle;margin-right:8px}\
    .alert{padding:8px 12px;border-radius:4px;margin:.4em 0}.alert.warn{background:#fff8c5;border:1px solid #9a6700}\
    .alert.full{background:#ffebe9;border:1px solid #cf222e}.alert.info{background:#ddf4ff;border:1px solid #54aeff}\
    .note{font-size:12px;margin:.2em 0}\
    .level-warn{color:#7d4e00;font-weight:600}.level-full{color:#a40e26;font-weight:600}\
    .lagging{color:#a40e26;font-weight:600}figure{margin:1em 0}figcaption{font-weight:600}\
    .charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(660px,1fr));gap:0 24px}\
    .legend{margin:.2em 0;font-size:12px}.swatch{display:inline-block;width:10px;height:10px;margin:0 4px 0 10px}\
    details{font-size:12px}code{font-size:12px}dt{font-weight:600}dd{margin:0 0 .4em 0}";

/// A whole page. It does not reload itself (an automatic refresh takes the page away from
/// someone still reading it, WCAG 2.2.1); each page links to itself instead.
pub fn layout(title: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                title { (title) " · exportd dashboard" }
                style { (PreEscaped(STYLE)) }
            }
            body { main { (body) } }
        }
    }
}

pub fn sign_in(error: Option<&str>) -> Markup {
    layout(
        "Sign in",
        html! {
            h1 { "exportd dashboard" }
            @if let Some(error) = error { p.alert.full role="alert" { (error) } }
            form method="post" action="/dashboard/signin" {
                label for="token" { "Tenant admin bearer token " }
                input id="token" name="token" type="password" size="60" autocomplete="off";
                " "
                button { "Sign in" }
            }
            p {
                "A tenant admin's token comes from "
                code { "exportd token --tenant <tenant> --principal <admin> --ttl 1h" }
                ", or ask for a one-minute sign-in link with it: "
                code { "POST /v1/dashboard/tickets" }
                "."
            }
        },
    )
}

pub fn message(title: &str, text: &str) -> Markup {
    layout(title, html! { h1 { (title) } p { (text) } p { a href="/dashboard" { "Back to the dashboard" } } })
}

/// What the overview shows.
pub struct Overview<'a> {
    pub tenant: &'a Tenant,
    pub usage: &'a Usage,
    pub history: &'a [Point],
    pub partners: &'a [PartnerActivity],
    /// How far each subscription's deliveries are behind.
    pub deliveries: &'a [Lag],
    /// The host tables attached to the tenant's datasets.
    pub attachments: &'a [crate::attach::Attachment],
    pub recent: &'a [ExportJob],
    pub now: OffsetDateTime,
}

/// One quota row: label, `data-metric` key, used, limit, how to show the numbers, and whether
/// nearing the limit is a warning (running exports at the limit are a busy tenant, not trouble:
/// the queue filling up is).
struct Gauge {
    label: &'static str,
    key: &'static str,
    used: i64,
    limit: u64,
    format: fn(i64) -> String,
    warns: bool,
}

impl Overview<'_> {
    fn gauges(&self) -> [Gauge; 4] {
        let (u, l) = (&self.usage.usage, &self.usage.limits);
        [
            Gauge {
                label: "Running exports",
                key: "running_exports",
                used: u.running_exports,
                limit: u64::from(l.max_running_exports),
                format: count,
                warns: false,
            },
            Gauge {
                label: "Queued exports",
                key: "queued_exports",
                used: u.queued_exports,
                limit: u64::from(l.max_queued_exports),
                format: count,
                warns: true,
            },
            Gauge {
                label: "Stored bytes",
                key: "stored_bytes",
                used: u.stored_bytes,
                limit: l.storage_bytes,
                format: bytes,
                warns: true,
            },
            Gauge {
                label: "Egress today",
                key: "egress_bytes_today",
                used: u.egress_bytes_today,
                limit: l.egress_bytes_per_day,
                format: bytes,
                warns: true,
            },
        ]
    }

    pub fn render(&self) -> Markup {
        let gauges = self.gauges();
        let u = &self.usage.usage;
        html! {
            h1 { (self.tenant.name) " " small { "(" (self.tenant.id.as_str()) ")" } }
            @for g in &gauges {
                @let percent = units::percent(g.used as f64, g.limit as f64);
                @if g.warns && percent >= 80.0 {
                    p class=(format!("alert {}", units::level(percent))) role=(if percent >= 100.0 { "alert" } else { "status" }) data-warning=(g.key) {
                        (g.label) " at " (format!("{percent:.0}")) " % of the limit: "
                        ((g.format)(g.used)) " of " ((g.format)(g.limit as i64)) "."
                    }
                } @else if !g.warns && percent >= 100.0 {
                    p.alert.info role="status" data-busy=(g.key) {
                        "All " (count(g.limit as i64)) " export slots are busy; " (count(u.queued_exports))
                        " queued " (if u.queued_exports == 1 { "export waits" } else { "exports wait" }) " for one."
                    }
                }
            }
            h2 { "Usage against limits" }
            table {
                thead { tr { th scope="col" { "Quota" } th scope="col" { "Used" } th scope="col" { "Limit" } th scope="col" { "Share" } } }
                tbody {
                    @for g in &gauges {
                        @let percent = units::percent(g.used as f64, g.limit as f64);
                        tr {
                            th scope="row" { (g.label) }
                            td { data value=(g.used) data-metric=(g.key) { ((g.format)(g.used)) } }
                            td { data value=(g.limit) data-limit=(g.key) { ((g.format)(g.limit as i64)) } }
                            td {
                                @let value = format!("{:.1}", percent.min(100.0));
                                @let label = format!("{} share of the limit", g.label);
                                @if g.warns {
                                    // Green below 80 %, yellow from 80 %, red at the limit: the alert's colours.
                                    meter min="0" max="100" low="80" high="99.95" optimum="0" value=(value) aria-label=(label) data-meter=(g.key) {}
                                    span class=(format!("level-{}", units::level(percent))) { (format!("{percent:.1}")) " %" }
                                } @else {
                                    meter min="0" max="100" value=(value) aria-label=(label) data-meter=(g.key) {}
                                    span { (format!("{percent:.1}")) " %" }
                                }
                            }
                        }
                    }
                    tr { th scope="row" { "Rows exported today" } td { data value=(u.rows_exported_today) data-metric="rows_exported_today" { (count(u.rows_exported_today)) } } td {} td {} }
                    tr { th scope="row" { "Rate-limited requests (all time)" } td { data value=(u.rate_limited_requests) data-metric="rate_limited_requests" { (count(u.rate_limited_requests)) } } td {} td {} }
                    tr { th scope="row" { "Other refusals (all time)" } td { data value=(u.quota_rejections) data-metric="quota_rejections" { (count(u.quota_rejections)) } } td {} td {} }
                }
            }
            h2 { "Refusals today" }
            table {
                thead { tr { @for kind in u.refusals_today.keys() { th scope="col" { (kind) } } } }
                tbody { tr { @for (kind, n) in &u.refusals_today { td data-refusals=(kind) { (count(*n)) } } } }
            }
            h2 { "Queue" }
            p {
                "Oldest queued: " (age(self.usage.queue.oldest_queued_age_seconds, "oldest_queued_age_seconds"))
                " · oldest running: " (age(self.usage.queue.oldest_running_age_seconds, "oldest_running_age_seconds"))
            }
            table {
                thead { tr { @for state in self.usage.queue.states.keys() { th scope="col" { (state) } } } }
                tbody { tr { @for (state, n) in &self.usage.queue.states { td data-state=(state) { (count(*n)) } } } }
            }
            h2 { "Last 30 days" }
            p.note data-charts-lag="true" {
                "The charts are recorded about once a minute, so the latest minute may not show in them yet; the tables above are live."
            }
            div.charts { (self.charts()) }
            h2 { "Partners" }
            (self.partners_table())
            h2 { "Deliveries into partners' buckets" }
            (self.deliveries_table())
            h2 { "Attached host tables" }
            (self.attachments_table())
            h2 { "Recent exports" }
            (self.recent_table())
            p { small { "As of " (relative(self.now, self.now)) " — " a href="/dashboard" { "reload" } " for newer numbers. Times are UTC; hover a relative time for the exact one." } }
        }
    }

    fn charts(&self) -> Markup {
        let labels: Vec<String> = self.history.iter().map(|p| day_label(p.start)).collect();
        let series =
            |name, key, f: fn(&Point) -> f64| Series { name, key, values: self.history.iter().map(f).collect() };
        let limits = &self.usage.limits;
        let charts = [
            BarChart {
                id: "egress",
                title: "Egress per day, against the daily limit",
                labels: &labels,
                series: vec![series("egress", "egress_bytes", |p| p.egress_bytes as f64)],
                stacked: true,
                limit: Some(limits.egress_bytes_per_day as f64),
                quantity: Quantity::Bytes,
            },
            BarChart {
                id: "storage",
                title: "Stored bytes (highest of the day), against the storage limit",
                labels: &labels,
                series: vec![series("stored", "stored_bytes_max", |p| p.stored_bytes_max as f64)],
                stacked: true,
                limit: Some(limits.storage_bytes as f64),
                quantity: Quantity::Bytes,
            },
            BarChart {
                id: "exports",
                title: "Exports finished per day, by outcome",
                labels: &labels,
                series: vec![
                    series("succeeded", "exports_succeeded", |p| p.exports_succeeded as f64),
                    series("failed", "exports_failed", |p| p.exports_failed as f64),
                    series("cancelled", "exports_cancelled", |p| p.exports_cancelled as f64),
                ],
                stacked: true,
                limit: None,
                quantity: Quantity::Count,
            },
            BarChart {
                id: "rows",
                title: "Rows exported per day",
                labels: &labels,
                series: vec![series("rows", "rows_exported", |p| p.rows_exported as f64)],
                stacked: true,
                limit: None,
                quantity: Quantity::Count,
            },
            BarChart {
                id: "refusals",
                title: "Refusals per day, by kind",
                labels: &labels,
                series: RefusalKind::ALL
                    .iter()
                    .map(|kind| Series {
                        name: kind.as_str(),
                        key: kind.as_str(),
                        values: self
                            .history
                            .iter()
                            .map(|p| p.refusals.get(kind.as_str()).copied().unwrap_or(0) as f64)
                            .collect(),
                    })
                    .collect(),
                stacked: true,
                limit: None,
                quantity: Quantity::Count,
            },
            BarChart {
                id: "durations",
                title: "Export durations, create to publish (the day's highest hourly percentile)",
                labels: &labels,
                series: vec![
                    series("p50", "export_seconds_p50", |p| p.export_seconds_p50.unwrap_or(0.0)),
                    series("p95", "export_seconds_p95", |p| p.export_seconds_p95.unwrap_or(0.0)),
                ],
                stacked: false,
                limit: None,
                quantity: Quantity::Seconds,
            },
            BarChart {
                id: "queued",
                title: "Queued exports (highest of the day), against the queue limit",
                labels: &labels,
                series: vec![series("queued", "queued_max", |p| p.queued_max as f64)],
                stacked: true,
                limit: Some(f64::from(limits.max_queued_exports)),
                quantity: Quantity::Count,
            },
            BarChart {
                id: "queue",
                title: "Oldest queued export (highest of the day)",
                labels: &labels,
                series: vec![series("queue age", "oldest_queued_seconds_max", |p| p.oldest_queued_seconds_max as f64)],
                stacked: true,
                limit: None,
                quantity: Quantity::Seconds,
            },
        ];
        html! { @for chart in &charts { (chart.render()) } }
    }

    fn partners_table(&self) -> Markup {
        html! {
            @if self.partners.is_empty() {
                p { "This tenant has no partner principals." }
            } @else {
                table {
                    thead { tr {
                        th scope="col" { "Partner" } th scope="col" { "Exports (30 days)" } th scope="col" { "Egress (30 days)" }
                        th scope="col" { "Last download" } th scope="col" { "Feeds: dataset, position, last pull" }
                        th scope="col" { "Schema versions received" }
                    } }
                    tbody {
                        @for partner in self.partners {
                            tr data-partner=(partner.principal) {
                                th scope="row" { (partner.principal) @if partner.disabled { " (disabled)" } }
                                td data-partner-exports=(partner.principal) { (count(partner.exports)) }
                                td { data value=(partner.egress_bytes) data-partner-egress=(partner.principal) { (bytes(partner.egress_bytes)) } }
                                td { @match partner.last_download_at { Some(at) => (relative(at, self.now)), None => "never" } }
                                td {
                                    @for feed in &partner.feeds {
                                        div data-feed=(format!("{}/{}", partner.principal, feed.dataset)) {
                                            code { (feed.dataset) } ": "
                                            @match feed.position_at {
                                                Some(at) => { "position " (relative(at, self.now)) }
                                                None => "never pulled",
                                            }
                                            @if let Some(at) = feed.last_read_at { ", last pull " (relative(at, self.now)) }
                                            @if feed.lagging { " " span.lagging data-lagging="true" { "lagging" } }
                                            @if let Some(lost) = &feed.history_lost {
                                                " " span.lagging data-history-lost=(lost.timeline) {
                                                    "refused " (count(lost.refusals)) " times since the database failed over to timeline "
                                                    (lost.timeline) ", last " (relative(lost.last_at, self.now)) ": it must re-base on a full export"
                                                }
                                            }
                                        }
                                    }
                                }
                                td { (self.schema_versions(&partner.principal)) }
                            }
                        }
                    }
                }
            }
        }
    }

    /// One row per host table attached to one of the tenant's datasets: its state, how far its
    /// backfill is and when it ends, and what it has written. Host table names are the
    /// operator's, not the tenant's: the dataset names the row.
    fn attachments_table(&self) -> Markup {
        html! {
            @if self.attachments.is_empty() {
                p { "No host table feeds this tenant's datasets (" code { "exportd attach" } ")." }
            } @else {
                table {
                    thead { tr {
                        th scope="col" { "Dataset" } th scope="col" { "State" } th scope="col" { "Backfill" }
                        th scope="col" { "Records written" } th scope="col" { "Last progress" }
                    } }
                    tbody {
                        @for a in self.attachments {
                            @let percent = units::percent(a.rows_done as f64, a.rows_estimate.max(a.rows_done).max(1) as f64);
                            tr data-attachment=(a.dataset) {
                                th scope="row" { code { (a.dataset) } }
                                td data-attachment-state=(a.state) {
                                    @if a.state == "backfilling" {
                                        "backfilling: exports and feeds of the dataset wait for it"
                                    } @else if a.state == "lost" {
                                        strong { "lost: " } (a.lost_reason.as_deref().unwrap_or("the host dropped the slot"))
                                        " — exports and feeds wait for an operator's resync"
                                    } @else if a.capture == "log" {
                                        "live: followed from the host's write-ahead log, "
                                        (bytes(a.lag_bytes.unwrap_or(0))) " behind, "
                                        (bytes(a.retained_bytes.unwrap_or(0))) " of WAL kept on the host"
                                    } @else {
                                        "live: every host write is captured in its own transaction"
                                    }
                                    @if let Some(error) = &a.last_error {
                                        br; strong { "failing: " } (error)
                                    }
                                    @if a.quarantined > 0 {
                                        br; strong data-attachment-quarantined=(a.quarantined) { (count(a.quarantined)) " rows quarantined" }
                                        " (the dataset refuses a value; kept out of exports and feeds)"
                                    }
                                }
                                td {
                                    meter min="0" max="100" value=(format!("{:.1}", percent)) aria-label="backfill progress" {}
                                    " " (count(a.rows_done)) " of about " (count(a.rows_estimate.max(a.rows_done))) " rows"
                                    @if a.state == "backfilling" {
                                        @if let Some(eta) = a.eta() { ", about " (duration(eta.as_secs_f64())) " left" }
                                    }
                                }
                                td { (count(a.rows_written)) }
                                td { (relative(a.updated_at, self.now)) }
                            }
                        }
                    }
                }
            }
        }
    }

    /// One row per subscription of the tenant file: its partner and bucket, the last delivery,
    /// and how far behind it is (exports published but not in the bucket yet, failures).
    fn deliveries_table(&self) -> Markup {
        html! {
            @if self.tenant.subscriptions.is_empty() {
                p { "This tenant delivers into no partner's bucket (no subscriptions in its tenant file)." }
            } @else {
                table {
                    thead { tr {
                        th scope="col" { "Subscription" } th scope="col" { "Partner" } th scope="col" { "Bucket" }
                        th scope="col" { "Delivers" } th scope="col" { "Last delivery" } th scope="col" { "Behind" }
                    } }
                    tbody {
                        @for subscription in &self.tenant.subscriptions {
                            @let lag = self.deliveries.iter().find(|l| l.subscription == subscription.name);
                            @let bucket = self.tenant.destination(&subscription.destination).map(|d| d.url.to_string());
                            tr data-subscription=(subscription.name) {
                                th scope="row" { (subscription.name) }
                                td { (subscription.principal.as_str()) }
                                td { code { (bucket.unwrap_or_default()) } " (" (subscription.destination) ")" }
                                td {
                                    code { (subscription.dataset) } " as " (subscription.format.name())
                                    @if subscription.full_exports { ": full exports" }
                                    @if let Some(every) = subscription.incremental_every {
                                        (if subscription.full_exports { ", " } else { ": " })
                                        "changes every " (duration(every.as_secs_f64()))
                                    }
                                }
                                td data-last-delivery=(subscription.name) {
                                    @match lag.and_then(|l| l.last_delivered_at) { Some(at) => (relative(at, self.now)), None => "never" }
                                }
                                td data-behind=(subscription.name) { (self.behind(lag)) }
                            }
                        }
                    }
                }
            }
        }
    }

    fn behind(&self, lag: Option<&Lag>) -> Markup {
        let Some(lag) = lag.filter(|l| l.undelivered > 0) else { return html! { "up to date" } };
        html! {
            data value=(lag.undelivered) { (count(lag.undelivered)) }
            (if lag.undelivered == 1 { " export not delivered" } else { " exports not delivered" })
            @if let Some(at) = lag.oldest_undelivered_at { ", the oldest published " (relative(at, self.now)) }
            @if lag.failed > 0 {
                " " span.lagging data-failed=(lag.failed) { (count(lag.failed)) " failed" }
                @if let Some(reason) = &lag.last_failure { ": " (reason) " (retry it: POST /v1/deliveries/{id}/retry)" }
            }
        }
    }

    /// Per dataset the partner is granted: the schema version it receives, and its pin when it
    /// holds it on an older major than the current one.
    fn schema_versions(&self, principal: &str) -> Markup {
        let Some(principal) = self.tenant.principal(principal) else { return html! {} };
        let tenant = self.tenant;
        let views = tenant.datasets.keys().filter_map(|name| ServedView::of(tenant, principal, name.as_str()).ok());
        html! {
            @for view in views {
                @let dataset = view.name();
                div data-schema=(format!("{}/{}", principal.id, dataset)) {
                    code { (dataset) } " " (view.schema.version.to_string())
                    @if let Some(major) = tenant.effective_pin(dataset.as_str(), principal) {
                        " " span.pinned data-pinned=(major) { "pinned to " (major) } " (current "
                        (view.current_version().to_string()) ")"
                    }
                }
            }
        }
    }

    fn recent_table(&self) -> Markup {
        html! {
            table {
                thead { tr {
                    th scope="col" { "Export" } th scope="col" { "Dataset" } th scope="col" { "By" } th scope="col" { "State" }
                    th scope="col" { "Rows done" } th scope="col" { "Expected rows" } th scope="col" { "ETA" } th scope="col" { "Created" }
                } }
                tbody {
                    @for job in self.recent {
                        @let outlook = job.outlook(self.now);
                        tr {
                            td { a href=(format!("/dashboard/exports/{}", job.id)) { code { (job.id) } } }
                            td { (job.dataset) } td { (job.principal) } td { (job.state.as_str()) }
                            td { (count(job.rows_done)) }
                            td data-expected-rows=(job.id) { @match outlook.rows_total_estimate { Some(n) => (count(n as i64)), None => "–" } }
                            td data-eta=(job.id) { @match outlook.eta_seconds { Some(s) => (duration(s as f64)), None => "–" } }
                            td { (relative(job.created_at, self.now)) }
                        }
                    }
                }
            }
        }
    }
}

fn age(seconds: Option<i64>, key: &str) -> Markup {
    html! {
        @match seconds {
            Some(s) => data value=(s) data-metric=(key) { (duration(s as f64)) },
            None => data value="" data-metric=(key) { "–" },
        }
    }
}

fn day_label(at: OffsetDateTime) -> String {
    format!("{} {}", &at.month().to_string()[..3], at.day())
}

/// What one export's page shows.
pub struct ExportPage<'a> {
    pub job: &'a ExportJob,
    pub shards: &'a [ShardRecord],
    pub events: &'a [AuditEntry],
    pub now: OffsetDateTime,
}

impl ExportPage<'_> {
    pub fn render(&self) -> Markup {
        let job = self.job;
        let outlook = job.outlook(self.now);
        let when =
            |at: Option<OffsetDateTime>| html! { @match at { Some(at) => (relative(at, self.now)), None => "–" } };
        html! {
            p { a href="/dashboard" { "← Dashboard" } }
            h1 { "Export " code { (job.id) } }
            dl {
                dt { "State" } dd data-field="state" { (job.state.as_str()) }
                @if let Some(code) = &job.error_code {
                    dt { "Why it ended" } dd data-field="error" { code { (code) } ": " (job.error_detail.as_deref().unwrap_or("")) }
                }
                dt { "Dataset, format, mode" } dd { (job.dataset) ", " (job.format.name()) ", " (job.mode.as_str()) }
                dt { "Requested by" } dd { (job.principal) }
                @if let Some(fingerprint) = &job.column_policy {
                    dt { "Column policy" } dd data-field="column-policy" {
                        "the partner's files are masked by its column policy " code { (fingerprint) }
                    }
                }
                @if !job.schema_version.is_empty() {
                    dt { "Schema version" } dd data-field="schema-version" { (job.schema_version) }
                }
                dt { "Created, started, finished" } dd { (when(Some(job.created_at))) ", " (when(job.started_at)) ", " (when(job.finished_at)) }
                dt { "Progress" } dd data-field="progress" {
                    (count(job.rows_done)) " rows"
                    @if let Some(total) = outlook.rows_total_estimate { " of " span data-field="expected-rows" { (count(total as i64)) } }
                    " in " (count(i64::from(job.shards_done))) " shards, " (bytes(job.bytes_done))
                }
                dt { "ETA" } dd data-field="eta" { @match outlook.eta_seconds { Some(s) => (duration(s as f64)), None => "–" } }
                @if let (Some(size), Some(sha256)) = (job.file_bytes, &job.file_sha256) {
                    dt { "File" } dd { (bytes(size)) ", sha256 " code { (sha256) } }
                }
                @if let Some(at) = job.expires_at { dt { "Files deleted" } dd { (relative(at, self.now)) } }
            }
            h2 { "Shards" }
            table {
                thead { tr { th scope="col" { "Shard" } th scope="col" { "Rows" } th scope="col" { "Size" } th scope="col" { "sha256" } } }
                tbody {
                    @for shard in self.shards {
                        tr data-shard=(shard.shard_index) {
                            td { (shard.shard_index) } td { (count(shard.rows)) } td { (bytes(shard.bytes)) } td { code { (shard.sha256) } }
                        }
                    }
                }
            }
            h2 { "Who did what (audit log)" }
            @if self.events.is_empty() {
                p { "Nothing recorded yet." }
            } @else {
                table {
                    thead { tr {
                        th scope="col" { "When" } th scope="col" { "Who" } th scope="col" { "What" } th scope="col" { "Object" }
                        th scope="col" { "Range" } th scope="col" { "Status" }
                    } }
                    tbody {
                        @for event in self.events {
                            tr data-event=(event.action) {
                                td { (relative(event.at, self.now)) } td { (event.principal) } td { (event.action) }
                                td { (event.object.as_deref().unwrap_or("")) } td { (event.byte_range.as_deref().unwrap_or("")) }
                                td { @if let Some(status) = event.status { (status) } }
                            }
                        }
                    }
                }
            }
        }
    }
}
