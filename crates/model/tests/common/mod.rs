//! Helpers shared by the op tests.

/// Asserts that `r` failed, with a message containing `needle` (which error, not just any).
#[track_caller]
pub fn expect_err<T: std::fmt::Debug, E: std::fmt::Display>(r: Result<T, E>, needle: &str) {
    let e = r.expect_err("expected an error").to_string();
    assert!(
        e.contains(needle),
        "expected an error containing {needle:?}, got: {e}"
    );
}
