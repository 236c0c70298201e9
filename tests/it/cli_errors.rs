//! What a person sees when a command fails for an expected reason: where it failed and what to
//! check, in plain lines — never a backtrace, even with RUST_BACKTRACE set.

use std::process::Command;

/// Runs `exportd` with `args` and `env`; returns (exit code, stdout, stderr).
fn exportd(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_exportd"));
    command.args(args).env("RUST_BACKTRACE", "1").env("EXPORTD_TENANTS_DIR", "tenants");
    for (name, value) in env {
        command.env(name, value);
    }
    let output = command.output().expect("exportd runs");
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (output.status.code(), text(&output.stdout), text(&output.stderr))
}

fn assert_plain(stderr: &str) {
    assert!(!stderr.to_lowercase().contains("backtrace"), "{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
}

#[test]
fn a_wrong_user_names_the_server_and_what_to_check() {
    // The test server (scripts/test may have started a private one), as a user it does not know.
    let server: sqlx::postgres::PgConnectOptions = std::env::var("DATABASE_URL").unwrap().parse().unwrap();
    let (host, port) = (server.get_host(), server.get_port());
    let url = format!("postgres://nobody-here@{host}:{port}/exportd_cli_errors");
    let (code, _, stderr) = exportd(&["migrate"], &[("DATABASE_URL", &url)]);
    assert_eq!(code, Some(1));
    assert_plain(&stderr);
    let target = format!("PostgreSQL at {host}:{port} (database `exportd_cli_errors`, user `nobody-here`)");
    assert!(stderr.contains(&target), "{stderr}");
    assert!(stderr.contains("role \"nobody-here\" does not exist"), "{stderr}");
    assert!(stderr.contains("check the user and password"), "{stderr}");
    assert!(!stderr.contains(" at line "), "no C source lines: {stderr}");
    assert_eq!(stderr.matches("does not exist").count(), 1, "the cause is said once: {stderr}");
}

#[test]
fn only_postgres_urls_are_accepted_and_passwords_are_never_repeated() {
    for url in ["mysql://root:hunter2@127.0.0.1/exportd", "postgress://me:hunter2@127.0.0.1/exportd"] {
        let (code, _, stderr) = exportd(&["migrate"], &[("DATABASE_URL", url)]);
        assert_eq!(code, Some(1), "{url}");
        assert_plain(&stderr);
        assert!(stderr.contains("DATABASE_URL must be a postgres:// URL"), "{stderr}");
        assert!(!stderr.contains("hunter2"), "{stderr}");
    }
}

#[test]
fn a_missing_tenants_directory_says_where_it_looked_and_how_to_point_elsewhere() {
    let (code, _, stderr) =
        exportd(&["token", "--tenant", "acme", "--principal", "alice"], &[("EXPORTD_TENANTS_DIR", "no-such-dir")]);
    assert_eq!(code, Some(1));
    assert_plain(&stderr);
    assert!(stderr.contains("no-such-dir") && stderr.contains("EXPORTD_TENANTS_DIR"), "{stderr}");
}

#[test]
fn no_token_is_printed_for_a_disabled_principal() {
    let (code, stdout, stderr) = exportd(&["token", "--tenant", "acme", "--principal", "mallory"], &[]);
    assert_eq!(code, Some(1));
    assert_eq!(stdout, "");
    assert!(stderr.contains("`mallory`") && stderr.contains("disabled"), "{stderr}");
    let (code, stdout, _) = exportd(&["token", "--tenant", "acme", "--principal", "alice"], &[]);
    assert_eq!(code, Some(0));
    assert_eq!(stdout.trim().split('.').count(), 3, "a JWT: {stdout}");
}

#[test]
fn unknown_names_are_answered_with_the_ones_there_are() {
    let (code, _, stderr) = exportd(&["token", "--tenant", "acne", "--principal", "alice"], &[]);
    assert_eq!(code, Some(1));
    assert_plain(&stderr);
    assert!(stderr.contains("no tenant `acne`") && stderr.contains("acme, globex"), "{stderr}");
    let (_, _, stderr) = exportd(&["token", "--tenant", "acme", "--principal", "alise"], &[]);
    assert!(stderr.contains("its principals: alice,"), "{stderr}");
    let (code, _, stderr) = exportd(&["serve", "--listen", "8080"], &[]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("e.g. 127.0.0.1:8080"), "an example of what --listen takes: {stderr}");
}
