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
    assert!(String::from_utf8_lossy(&run.stderr).contains("--token"), "the missing token is named");
    let run = Command::new(env!("CARGO_BIN_EXE_exportd-client"))
        .args(["download", "0190a0c0-0000-4000-8000-000000000000", "--out", "/tmp", "--url", "http://127.0.0.1:9"])
        .args(["--token", "t"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(stderr.starts_with("error: ") && !stderr.contains("backtrace") && !stderr.contains("panicked"), "{stderr}");
}
