//! A response body that reports its end: the connection needs to know when
//! an answer is over (its idle clock starts), the access log whether it went
//! out in full. Both wrap the body in one [`Reported`].

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use http_body::{Frame, SizeHint};

/// What learns how a response body ended.
pub trait BodyEnd: Send + Unpin + 'static {
    /// The body is over: sent to its end (`complete`), or dropped before
    /// (the client went away, the connection closed). Called once.
    fn ended(self, complete: bool);
}

/// A response body whose frames and size are the wrapped body's (a JSON
/// answer keeps its `content-length`), and that tells its [`BodyEnd`] how
/// it ended when it is dropped.
pub struct Reported<E: BodyEnd> {
    body: Body,
    end: Option<E>,
    complete: bool,
}

impl<E: BodyEnd> Reported<E> {
    /// `body`, reporting its end to `end`.
    pub fn new(body: Body, end: E) -> Self {
        Reported {
            body,
            end: Some(end),
            complete: false,
        }
    }

    /// `body` wrapped, as an axum body.
    pub fn wrap(body: Body, end: E) -> Body {
        Body::new(Self::new(body, end))
    }
}

impl<E: BodyEnd> HttpBody for Reported<E> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.complete = true,
            Poll::Ready(Some(Ok(_))) if this.body.is_end_stream() => this.complete = true,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl<E: BodyEnd> Drop for Reported<E> {
    fn drop(&mut self) {
        if let Some(end) = self.end.take() {
            end.ended(self.complete);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    struct Seen(Arc<Mutex<Vec<bool>>>);

    impl BodyEnd for Seen {
        fn ended(self, complete: bool) {
            self.0.lock().unwrap().push(complete);
        }
    }

    #[tokio::test]
    async fn a_body_read_to_its_end_is_complete_and_a_dropped_one_is_not() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let read = Reported::wrap(Body::from("answer"), Seen(seen.clone()));
        let bytes = axum::body::to_bytes(read, 1 << 10).await.unwrap();
        assert_eq!(&bytes[..], b"answer");
        drop(Reported::wrap(Body::from("never sent"), Seen(seen.clone())));
        assert_eq!(*seen.lock().unwrap(), [true, false]);
    }
}
