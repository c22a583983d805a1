//! `petite serve`: one policy behind gRPC — observations in as typed tensors, chunks of actions
//! out, with `Info` and `Health` beside `Act`.
//!
//! The wire is `proto/petite/v1/policy.proto` (package `petite.v1`), compiled at build time by
//! protox (pure Rust; no `protoc` anywhere) into [`pb`]. Nothing is unpickled: a request is
//! decoded into [`Array`]s whose bytes, shape and dtype must agree, or it is refused naming the
//! key.
//!
//! This crate knows no model: it serves any [`Backend`] (petite's `Policy` is one, in the
//! `petite` crate), so the exporter's crates never link a network stack and the server's
//! behaviour (limits, queue, deadlines, shutdown) is tested here without a model.
//!
//! [`Client`] is the other end: blocking calls over the same stubs, for robot loops and the
//! Python package's `petite.Client`.
//!
//! What a server does with a call ([`Server::start`]):
//! - a request above the message limit is refused by tonic's decoder before any handler runs
//!   (`OUT_OF_RANGE`, "decoded message length too large"), other calls unaffected;
//! - a malformed tensor or a bad observation is `INVALID_ARGUMENT`, naming the key;
//! - RTC options without their leftover or delay are `INVALID_ARGUMENT`;
//! - at most `queue + 1` calls are in the backend at once (one running, `queue` waiting); one
//!   more is `RESOURCE_EXHAUSTED` at once, never queued without bound;
//! - a client's deadline (`grpc-timeout`) ends its call with `CANCELLED` ("Timeout expired":
//!   tonic's server status); a chunk already started still finishes and holds its place in the
//!   queue until it does, so the bound stays true;
//! - [`Server::shutdown`] (SIGTERM or SIGINT in `petite serve`) stops taking connections, lets
//!   the calls in flight finish, then returns.
#![deny(missing_docs)]

mod backend;
mod client;
mod server;
mod service;
mod tensor;

pub use backend::{Backend, Call, Camera, Chunk, PolicyInfo, Refusal, RtcCall};
pub use client::{Client, Reply, ServerInfo};
pub use server::{Options, Server, termination};
pub use tensor::Array;

/// The `petite.v1` messages and the `Policy` service's client and server, generated from
/// `proto/petite/v1/policy.proto`.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("petite.v1");
}

/// Errors of starting, running and stopping a server, and of decoding a tensor.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The listening address cannot be bound (in use, not this machine's, no permission).
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: std::net::SocketAddr,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The server stopped with an error of its transport.
    #[error("the gRPC server failed: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The server's task ended abnormally (it panicked).
    #[error("the gRPC server's task failed: {0}")]
    Task(String),
    /// Waiting for SIGTERM or SIGINT could not be set up.
    #[error("cannot wait for SIGTERM/SIGINT: {0}")]
    Signal(#[source] std::io::Error),
    /// A client could not reach the server (nothing listening, a bad address, the connect
    /// timeout passed).
    #[error("cannot connect to {target}: {reason}")]
    Connect {
        /// The address as given (`http://host:port`).
        target: String,
        /// Why.
        reason: String,
    },
    /// The server answered a call with a status other than OK (its code and message: see the
    /// `.proto` for what each code means).
    #[error("the server refused the call ({code:?}): {message}")]
    Status {
        /// The gRPC status code.
        code: tonic::Code,
        /// The server's message.
        message: String,
    },
    /// A client's runtime (its I/O thread) could not start.
    #[error("cannot start the client's I/O thread: {0}")]
    Runtime(#[source] std::io::Error),
    /// A tensor is not what its dtype and shape say (names the key, expected vs found).
    #[error("`{key}`: {reason}")]
    Tensor {
        /// The observation's key (or `noise`, `rtc.prev_chunk_left_over`).
        key: String,
        /// What is wrong.
        reason: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
