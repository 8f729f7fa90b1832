//! The byte budget of request bodies held in memory: every body the
//! gateway reads whole holds its bytes here while it is read
//! ([`Reading`]), so slow clients cannot together hold more than the
//! budget; an OpenAI request's body (read whole, since its `model` names
//! the app) keeps them while it waits with its request in the hold queue.
//! The queue bounds how many wait; [`Buffered`] bounds their bytes, over
//! every app, so a burst of large bodies at a starting app cannot exhaust
//! memory. A body gives its bytes back when it is handed to a replica's
//! connection (or dropped).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, ErrorKind};

/// The budget (`limits.max_buffered_body_bytes`).
#[derive(Debug, Clone)]
pub struct Buffered {
    bytes: Arc<Semaphore>,
    limit: u64,
}

impl Buffered {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Self {
        let permits = usize::try_from(limit)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        Buffered {
            bytes: Arc::new(Semaphore::new(permits)),
            limit,
        }
    }

    /// `bytes` as a body that holds its share of the budget until it is
    /// sent on, or `429 queue_full` when the budget is spent.
    pub fn hold(&self, bytes: Bytes) -> Result<HeldBody, Error> {
        let mut reading = self.reading();
        reading.cover(bytes.len() as u64)?;
        Ok(reading.into_held(bytes))
    }

    /// A share of the budget for a body being read, grown with it by
    /// [`Reading::cover`]: a client that sends bodies slowly holds their
    /// bytes in the budget too, so many of them at once cannot exhaust
    /// memory before any is whole.
    pub fn reading(&self) -> Reading {
        Reading {
            budget: self.clone(),
            permit: None,
            covered: 0,
        }
    }

    /// Bytes held now.
    pub fn held(&self) -> u64 {
        let free = self.bytes.available_permits() as u64;
        self.limit.saturating_sub(free)
    }
}

/// A body being read, and the share of the budget its bytes hold; given
/// back when dropped.
#[derive(Debug)]
pub struct Reading {
    budget: Buffered,
    permit: Option<OwnedSemaphorePermit>,
    covered: u64,
}

impl Reading {
    /// Makes the share cover `total` bytes, or `429 queue_full` when the
    /// budget is spent.
    pub fn cover(&mut self, total: u64) -> Result<(), Error> {
        let Some(more) = total.checked_sub(self.covered).filter(|n| *n > 0) else {
            return Ok(());
        };
        let n = u32::try_from(more).unwrap_or(u32::MAX);
        match self.budget.bytes.clone().try_acquire_many_owned(n) {
            Ok(p) => {
                match &mut self.permit {
                    Some(held) => held.merge(p),
                    None => self.permit = Some(p),
                }
                self.covered += u64::from(n);
                Ok(())
            }
            Err(_) => {
                metrics::counter!("warmgate_buffered_body_refusals_total").increment(1);
                Err(Error::new(
                    ErrorKind::QueueFull,
                    format!(
                        "the gateway already holds {} bytes of request bodies being read or \
                         waiting for replicas (limits.max_buffered_body_bytes); retry shortly",
                        self.budget.limit
                    ),
                )
                .retry_after(1))
            }
        }
    }
}

impl Reading {
    /// The body read whole, holding the share it took while it was read
    /// until it is sent on: it never has to win the budget twice.
    pub fn into_held(self, bytes: Bytes) -> HeldBody {
        HeldBody {
            bytes: Some(bytes),
            permit: self.permit,
        }
    }
}

/// A whole body in memory, with its share of the budget.
#[derive(Debug)]
pub struct HeldBody {
    bytes: Option<Bytes>,
    permit: Option<OwnedSemaphorePermit>,
}

impl http_body::Body for HeldBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        // Handed to the connection: its write buffer has it now.
        self.permit = None;
        Poll::Ready(
            self.bytes
                .take()
                .filter(|b| !b.is_empty())
                .map(|b| Ok(Frame::data(b))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.bytes.as_ref().is_none_or(Bytes::is_empty)
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.bytes.as_ref().map_or(0, |b| b.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body as _;
    use http_body_util::BodyExt as _;

    #[test]
    fn a_body_being_read_holds_its_bytes_until_dropped() {
        let budget = Buffered::new(10);
        let mut a = budget.reading();
        a.cover(4).expect("fits");
        a.cover(3).expect("already covered");
        a.cover(8).expect("grows");
        assert_eq!(budget.held(), 8);
        let mut b = budget.reading();
        let err = b.cover(3).expect_err("over");
        assert_eq!(err.kind, ErrorKind::QueueFull);
        assert!(err.message.contains("being read"), "{}", err.message);
        b.cover(2).expect("what is left");
        drop(a);
        assert_eq!(budget.held(), 2);
        drop(b);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test]
    async fn bodies_hold_their_bytes_until_sent_on() {
        let budget = Buffered::new(10);
        let a = budget.hold(Bytes::from_static(b"123456")).expect("fits");
        assert_eq!(budget.held(), 6);
        let err = budget.hold(Bytes::from_static(b"12345")).expect_err("over");
        assert_eq!(err.kind, ErrorKind::QueueFull);
        assert!(
            err.message.contains("max_buffered_body_bytes"),
            "{}",
            err.message
        );
        assert_eq!(a.size_hint().exact(), Some(6));
        let sent = a.collect().await.expect("infallible").to_bytes();
        assert_eq!(&sent[..], b"123456");
        assert_eq!(budget.held(), 0, "given back once sent on");
        let b = budget
            .hold(Bytes::from_static(b"1234567890"))
            .expect("fits again");
        drop(b);
        assert_eq!(budget.held(), 0, "given back when dropped");
        let empty = budget.hold(Bytes::new()).expect("empty");
        assert!(empty.is_end_stream());
    }
}
