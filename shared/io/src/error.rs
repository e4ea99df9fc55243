//! The library error type. Every error says whether retrying the same operation can help
//! (`is_retryable`), so callers decide between "leave the message for redelivery" and "give up".

use aws_sdk_sqs::config::http::HttpResponse;
use aws_sdk_sqs::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};

/// The error an underlying client (AWS SDK, lapin) gave, kept as the source of ours.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result alias for the shared library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which external service an error came from (the domain's: the service a billed request is of).
pub use fleet_domain::requests::Service;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The service could not be reached at all (connection refused, DNS, timeout). `source`: the
    /// SDK's or lapin's error, when there is one.
    #[error("cannot reach {service} at {endpoint}: {detail}")]
    Unreachable {
        service: Service,
        endpoint: String,
        detail: String,
        #[source]
        source: Option<BoxError>,
    },
    /// The service answered with an error. `source`: the SDK's error, when there is one.
    #[error("{service} {operation} failed: {detail}")]
    Service {
        service: Service,
        operation: &'static str,
        detail: String,
        retryable: bool,
        #[source]
        source: Option<BoxError>,
    },
    /// The service did not answer in time (attempt timeout or the call's deadline).
    #[error("{service} {operation}: no answer within {after:?} ({attempts} attempt(s))")]
    Timeout { service: Service, operation: &'static str, after: std::time::Duration, attempts: u32 },
    /// A named resource (queue, bucket, object) does not exist; `what` says which, in a full phrase.
    #[error("{service}: {what}")]
    NotFound { service: Service, what: String },
    /// Data that failed an integrity or format check (checksum, size cap, schema). Never retryable.
    #[error("corrupt data: {0}")]
    Corrupt(String),
    /// A conditional write lost: another writer changed the object first (a lease or checkpoint now
    /// held by someone else). Never retryable: the caller has lost ownership.
    #[error("conflict: {0}")]
    Conflict(String),
    /// Bad configuration or arguments.
    #[error("configuration: {0}")]
    Config(String),
    /// A local temporary file (what a large object is written through on its way to the store) could
    /// not be written or read: the disk is full or not writable. Retryable: space may free up.
    #[error("local file: {0}")]
    LocalFile(String),
}

impl Error {
    /// Whether retrying the same operation later may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Unreachable { .. } | Error::Timeout { .. } | Error::LocalFile(_) => true,
            Error::Service { retryable, .. } => *retryable,
            Error::NotFound { .. } | Error::Corrupt(_) | Error::Config(_) | Error::Conflict(_) => false,
        }
    }

    /// Whether the failure is the infrastructure's (no answer, refused connection, 5xx, throttle):
    /// the dependency is in trouble, not the request. What the breakers count.
    pub fn is_outage(&self) -> bool {
        match self {
            Error::Unreachable { .. } | Error::Timeout { .. } => true,
            Error::Service { retryable, .. } => *retryable,
            _ => false,
        }
    }

    /// The dependency an outage is of.
    pub fn service(&self) -> Option<Service> {
        match self {
            Error::Unreachable { service, .. } | Error::Service { service, .. } | Error::Timeout { service, .. } | Error::NotFound { service, .. } => {
                Some(*service)
            }
            _ => None,
        }
    }

    /// A local file operation that failed, naming the file.
    pub fn local_file(path: &std::path::Path, e: impl std::fmt::Display) -> Error {
        Error::LocalFile(format!("{}: {e}", path.display()))
    }

    /// Data a caller's own checks found corrupt (e.g. the domain's: `.map_err(Error::corrupt)`).
    pub fn corrupt(detail: impl Into<String>) -> Error {
        Error::Corrupt(detail.into())
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Self {
        Error::Corrupt(format!("invalid JSON: {e}"))
    }
}

/// The innermost cause of an error, the one a person can act on ("Connection refused (os error
/// 111)", "dns error: failed to lookup address"), instead of the SDK's whole chain of wrappers (the
/// full chain stays the error's `source`).
pub fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    let s = cur.to_string();
    if s.is_empty() || s == "dispatch failure" {
        format!("{}", DisplayErrorContext(e))
    } else {
        s
    }
}

/// Maps an SDK error to the library error, telling unreachable endpoints apart from service errors.
pub(crate) fn sdk_error<E>(op: crate::op::Op, endpoint: &str, e: SdkError<E, HttpResponse>) -> Error
where
    E: ProvideErrorMetadata + std::error::Error + Send + Sync + 'static,
{
    let (service, operation) = (op.service(), op.name());
    match &e {
        SdkError::DispatchFailure(_) | SdkError::TimeoutError(_) => {
            Error::Unreachable { service, endpoint: endpoint.to_string(), detail: root_cause(&e), source: Some(Box::new(e)) }
        }
        SdkError::ServiceError(se) => {
            let code = se.err().code().unwrap_or("");
            let detail = format!("{code}: {}", se.err().message().unwrap_or("(no message)"));
            if matches!(code, "AWS.SimpleQueueService.NonExistentQueue" | "QueueDoesNotExist" | "NoSuchBucket" | "NoSuchKey") {
                return Error::NotFound { service, what: detail };
            }
            let retryable = matches!(code, "ThrottlingException" | "RequestThrottled" | "SlowDown" | "InternalError" | "ServiceUnavailable" | "KmsThrottled")
                || se.raw().status().as_u16() >= 500;
            Error::Service { service, operation, detail, retryable, source: Some(Box::new(e)) }
        }
        _ => Error::Service { service, operation, detail: format!("{}", DisplayErrorContext(&e)), retryable: true, source: Some(Box::new(e)) },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::Op;
    use aws_sdk_sqs::operation::get_queue_url::GetQueueUrlError;

    #[test]
    fn sdk_errors_keep_their_source_and_say_whether_to_retry() {
        let timeout: SdkError<GetQueueUrlError, HttpResponse> = SdkError::timeout_error("connect timed out");
        let e = sdk_error(Op::SqsGetQueueUrl, "http://127.0.0.1:1", timeout);
        assert!(matches!(e, Error::Unreachable { .. }) && e.is_retryable(), "{e:?}");
        let source = std::error::Error::source(&e).expect("the SDK's error is the source");
        assert!(source.to_string().contains("timeout") || format!("{source:?}").contains("connect timed out"), "{source:?}");
        // The message a user sees is unchanged by the chain.
        assert!(e.to_string().starts_with("cannot reach SQS at http://127.0.0.1:1: "), "{e}");
    }
}
