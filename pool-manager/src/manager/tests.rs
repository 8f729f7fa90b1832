//! Unit tests of `manager`.

use super::*;

#[test]
fn crash_backoff_grows_and_caps() {
    assert_eq!(crash_backoff(0), Duration::ZERO);
    assert_eq!(crash_backoff(1), Duration::ZERO);
    assert_eq!(crash_backoff(2), Duration::from_millis(500));
    assert_eq!(crash_backoff(3), Duration::from_secs(1));
    assert_eq!(crash_backoff(8), Duration::from_secs(32));
    assert_eq!(crash_backoff(12), BACKOFF_CAP);
    assert_eq!(crash_backoff(u32::MAX), BACKOFF_CAP);
}
