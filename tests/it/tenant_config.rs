//! Start-up validation of tenant files: every mistake stops start-up naming the file and the field.

use std::path::Path;

use exportd::tenants::Registry;

const SCHEMA: &str = "name = \"tickets\"\nkey_column = \"id\"\n[[columns]]\nname = \"subject\"\ntype = \"string\"\n[[columns]]\nname = \"region\"\ntype = \"string\"\n";

const GOOD: &str = r#"
id = "acme"
name = "Acme"
datasets = ["tickets"]

[[keys]]
kid = "k1"
secret = "0123456789abcdef0123456789abcdef"

[[principals]]
id = "alice"
role = "admin"

[[principals]]
id = "p1"
role = "partner"
grants = ["tickets"]
row_filter = { region = "emea" }
"#;

fn hook(url: &str, events: &str, secret: &str) -> String {
    format!("\n[[webhooks]]\nname = \"ops\"\nurl = \"{url}\"\nevents = {events}\n{secret}\n")
}

fn write_tree(dir: &Path, files: &[(&str, &str)]) {
    std::fs::create_dir_all(dir.join("datasets")).unwrap();
    std::fs::write(dir.join("datasets/tickets.toml"), SCHEMA).unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
}

fn load(files: &[(&str, &str)]) -> Result<Registry, String> {
    let dir = tempfile::tempdir().unwrap();
    write_tree(dir.path(), files);
    Registry::load(dir.path()).map_err(|e| e.to_string())
}

#[test]
fn the_shipped_and_fixture_tenants_load() {
    let shipped = Registry::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tenants")).unwrap();
    assert!(shipped.get("acme").is_some() && shipped.get("globex").is_some());
    let fixtures = crate::common::fixture_registry();
    assert!(fixtures.get("acme").unwrap().principal("mallory").unwrap().disabled);
    assert!(load(&[("acme.toml", GOOD)]).is_ok());
}

#[test]
fn each_mistake_names_the_file_and_the_field() {
    let cases: Vec<(&str, String, &str)> = vec![
        ("unknown field", GOOD.replace("name = \"Acme\"", "name = \"Acme\"\ncolour = \"red\""), "unknown field `colour`"),
        ("unknown quota field", format!("{GOOD}\n[quota]\nmax_exports = 3\n"), "unknown field `max_exports`"),
        ("missing id", GOOD.replace("id = \"acme\"\n", ""), "missing field `id`"),
        ("grant to an unknown dataset", GOOD.replace("grants = [\"tickets\"]", "grants = [\"tix\"]"), "principals[1].grants[0]"),
        ("unknown exposed dataset", GOOD.replace("datasets = [\"tickets\"]", "datasets = [\"tickets\", \"orders\"]"), "datasets[1]: unknown dataset `orders`"),
        ("duplicate kid", GOOD.replace("[[principals]]\nid = \"alice\"", "[[keys]]\nkid = \"k1\"\nsecret = \"0123456789abcdef0123456789abcdef\"\n\n[[principals]]\nid = \"alice\""), "keys[1].kid: duplicate kid `k1`"),
        ("short secret", GOOD.replace("0123456789abcdef0123456789abcdef", "short"), "keys[0].secret"),
        ("secret from a missing env var", GOOD.replace("secret = \"0123456789abcdef0123456789abcdef\"", "secret_env = \"EXPORTD_TEST_UNSET_VAR\""), "keys[0].secret_env"),
        ("row filter on an unknown column", GOOD.replace("region = \"emea\"", "country = \"de\""), "principals[1].row_filter.country"),
        ("row filter of the wrong type", GOOD.replace("region = \"emea\"", "region = 5"), "principals[1].row_filter.region"),
        ("bad role", GOOD.replace("role = \"admin\"", "role = \"root\""), "unknown variant `root`"),
        ("id differs from the file name", GOOD.replace("id = \"acme\"", "id = \"other\""), ": id: must match the file name"),
        ("zero rate", format!("{GOOD}\n[quota]\napi_requests_per_second = 0\n"), "quota.api_requests_per_second"),
        ("a value of the wrong type", format!("{GOOD}\n[quota]\nmax_running_exports = \"two\"\n"), "quota.max_running_exports: invalid type"),
        ("duplicate principal", format!("{GOOD}\n[[principals]]\nid = \"alice\"\nrole = \"admin\"\n"), "principals[2].id"),
        ("webhook URL not http(s)", format!("{GOOD}{}", hook("ftp://hooks.example.com/x", "[\"export.succeeded\"]", "secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"")), "webhooks[0].url"),
        ("webhook URL with credentials", format!("{GOOD}{}", hook("https://u:p@hooks.example.com/x", "[\"export.succeeded\"]", "secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"")), "webhooks[0].url: must not carry credentials"),
        ("unknown webhook event", format!("{GOOD}{}", hook("https://hooks.example.com/x", "[\"export.done\"]", "secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"")), "unknown variant `export.done`"),
        ("no webhook events", format!("{GOOD}{}", hook("https://hooks.example.com/x", "[]", "secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"")), "webhooks[0].events"),
        ("webhook secret not whsec_", format!("{GOOD}{}", hook("https://hooks.example.com/x", "[\"export.failed\"]", "secret = \"plain-secret-of-enough-length-000000\"")), "webhooks[0].secret: a Standard Webhooks secret"),
        ("webhook secret from a missing env var", format!("{GOOD}{}", hook("https://hooks.example.com/x", "[\"export.failed\"]", "secret_env = \"EXPORTD_TEST_UNSET_VAR\"")), "webhooks[0].secret_env: environment variable `EXPORTD_TEST_UNSET_VAR`"),
        ("webhook scoped to an unknown principal", format!("{GOOD}{}principals = [\"bob\"]\n", hook("https://hooks.example.com/x", "[\"export.failed\"]", "secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"")), "webhooks[0].principals[0]: no principal `bob`"),
        ("duplicate webhook name", format!("{GOOD}{0}{0}", hook("https://hooks.example.com/x", "[\"export.failed\"]", "secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"")), "webhooks[1].name: duplicate endpoint `ops`"),
    ];
    for (what, text, expected) in cases {
        let err = load(&[("acme.toml", &text)]).expect_err(what);
        assert!(err.contains("acme.toml"), "{what}: no file name in {err:?}");
        assert!(err.contains(expected), "{what}: expected {expected:?} in {err:?}");
    }
}

#[test]
fn a_kid_used_by_two_tenants_names_both_files() {
    let other = GOOD.replace("id = \"acme\"", "id = \"globex\"");
    let err = load(&[("acme.toml", GOOD), ("globex.toml", &other)]).unwrap_err();
    assert!(err.contains("globex.toml: keys[0].kid: duplicate kid `k1`"), "{err}");
    assert!(err.contains("acme.toml"), "{err}");
}

#[test]
fn the_line_of_a_syntax_error_is_reported() {
    let err = load(&[("acme.toml", "id = \"acme\"\nname = \n")]).unwrap_err();
    assert!(err.contains("acme.toml") && err.contains("line 2"), "{err}");
}

#[test]
fn a_broken_config_stops_the_server_before_it_listens() {
    let dir = tempfile::tempdir().unwrap();
    write_tree(dir.path(), &[("acme.toml", &GOOD.replace("grants = [\"tickets\"]", "grants = [\"tix\"]"))]);
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_exportd"))
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("EXPORTD_TENANTS_DIR", dir.path())
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/never")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("acme.toml: principals[1].grants[0]"), "{stderr}");
}

#[test]
fn column_policy_mistakes_name_the_principal_dataset_and_column() {
    let masking = "\n[masking]\nsecret = \"0123456789abcdef0123456789abcdef-masking\"\n";
    let policy = |rules: &str| format!("{GOOD}column_policy.tickets = {{ {rules} }}\n{masking}");
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "unknown column",
            policy("emial = \"drop\""),
            "principals[1].column_policy.tickets.emial: dataset `tickets` has no column `emial`",
        ),
        ("unknown rule", policy("subject = \"mask\""), "`mask` is not a column rule"),
        ("truncate of nothing", policy("subject = \"truncate(0)\""), "truncate keeps 1 to"),
        (
            "the key dropped",
            policy("id = \"drop\""),
            "principals[1].column_policy.tickets.id: the key column `id` can only be hashed",
        ),
        (
            "hash without a secret",
            format!("{GOOD}column_policy.tickets = {{ subject = \"hash\" }}\n"),
            "principals[1].column_policy.tickets.subject: a `hash` rule needs the tenant's `[masking]` secret",
        ),
        (
            "a dataset not granted",
            format!("{GOOD}column_policy.orders = {{ subject = \"drop\" }}\n"),
            "principals[1].column_policy.orders: `orders` is not granted",
        ),
        (
            "a policy for an admin",
            GOOD.replace("role = \"admin\"", "role = \"admin\"\ncolumn_policy.tickets = { subject = \"drop\" }"),
            "principals[0].column_policy: column policies apply to partners only",
        ),
        (
            "a short masking secret",
            format!("{GOOD}\n[masking]\nsecret = \"short\"\n"),
            "masking.secret: the masking secret needs at least 32 bytes",
        ),
    ];
    for (what, text, expected) in cases {
        let err = load(&[("acme.toml", &text)]).expect_err(what);
        assert!(err.contains("acme.toml") && err.contains(expected), "{what}: expected {expected:?} in {err:?}");
    }
    let good = load(&[("acme.toml", &policy("id = \"hash\", subject = \"truncate(4)\", region = \"null\""))]).unwrap();
    let partner = good.get("acme").unwrap().principal("p1").unwrap();
    assert!(partner.column_policy("tickets").unwrap().hashes_keys());
}
