//! The `exportd-client` binary on its own: what a partner sees before any server is involved.
//! (Its downloads and pulls against a real server are tested in the workspace's tests/client.rs,
//! which runs this binary.)

use std::process::Command;

fn client(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_exportd-client"))
        .args(args)
        .env_remove("EXPORTD_TOKEN")
        .env_remove("EXPORTD_URL")
        .output()
        .expect("exportd-client runs")
}

#[test]
fn help_lists_download_and_pull_and_no_server_settings() {
    let help = String::from_utf8(client(&["--help"]).stdout).unwrap();
    assert!(help.contains("download") && help.contains("pull"), "{help}");
    assert!(!help.contains("DATABASE_URL") && !help.contains("serve"), "{help}");
}

#[test]
fn an_unreachable_server_is_one_plain_error_line_per_cause() {
    let run = client(&["pull", "--dataset", "tickets", "--cursor-file", "/nonexistent/c", "--out", "/nonexistent/o"]);
    assert!(!run.status.success());
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("EXPORTD_TOKEN") && stderr.contains("--token"), "how to give the token: {stderr}");
    let run = Command::new(env!("CARGO_BIN_EXE_exportd-client"))
        .args(["download", "0190a0c0-0000-4000-8000-000000000000", "--out", "/tmp", "--url", "http://127.0.0.1:9"])
        .args(["--token", "t"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(stderr.starts_with("error: ") && !stderr.contains("backtrace") && !stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_server_that_does_not_answer_gets_a_hint_about_the_url() {
    let run = client(&["pull", "--dataset", "tickets", "--cursor-file", "/nonexistent/c", "--out", "/nonexistent/o"]);
    assert!(!run.status.success());
    let run = Command::new(env!("CARGO_BIN_EXE_exportd-client"))
        .args(["pull", "--dataset", "tickets", "--cursor-file", "/tmp/exportd-client-test-no-cursor"])
        .args(["--out", "/tmp/exportd-client-test-out", "--url", "http://127.0.0.1:9", "--token", "t"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(
        stderr.contains("hint: no server answered at http://127.0.0.1:9") && stderr.contains("EXPORTD_URL"),
        "{stderr}"
    );
}

#[test]
fn a_url_without_a_scheme_is_refused_with_an_example() {
    let run = client(&["download", "x", "--out", "/tmp", "--url", "localhost:8080", "--token", "t"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(stderr.contains("must start with http:// or https://") && stderr.contains("e.g. http://"), "{stderr}");
    assert!(!stderr.contains("relative URL"), "{stderr}");
}

#[test]
fn rates_take_units_like_curl_and_bad_ones_say_what_is_expected() {
    // Accepted (the run then fails on the unreachable server, after parsing).
    for rate in ["1M", "500K", "2MiB", "1048576"] {
        let run = client(&[
            "download",
            "x",
            "--out",
            "/tmp",
            "--url",
            "http://127.0.0.1:9",
            "--token",
            "t",
            "--limit-rate",
            rate,
        ]);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(!stderr.contains("--limit-rate"), "{rate} is a rate: {stderr}");
    }
    let run = client(&["download", "x", "--out", "/tmp", "--token", "t", "--limit-rate", "fast"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("--limit-rate") && stderr.contains("e.g. 500K"), "{stderr}");
}

#[test]
fn every_pull_option_is_explained() {
    let help = String::from_utf8(client(&["pull", "--help"]).stdout).unwrap();
    assert!(help.contains("--dataset") && help.contains("dataset whose changes to follow"), "{help}");
}
