//! Starting a server on an address, and stopping it gracefully.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::server::TcpIncoming;

use crate::backend::Backend;
use crate::pb::policy_server::PolicyServer;
use crate::service::PolicyService;
use crate::{Error, Result};

/// How a server listens and what it accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Where to listen (port 0: any free port, see [`Server::local_addr`]).
    pub listen: SocketAddr,
    /// The largest request decoded, in bytes (and the largest reply sent); a larger request
    /// is refused before it is buffered. Three f32 camera images of 480×640 are ~11 MiB.
    pub max_message_bytes: usize,
    /// `Act` calls that may wait while one chunk runs; one more is refused at once with
    /// `RESOURCE_EXHAUSTED`.
    pub queue: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            max_message_bytes: 64 << 20,
            queue: 8,
        }
    }
}

/// A running server: its task on the current tokio runtime, and the handle that stops it.
/// Dropping it stops the server too, gracefully, without waiting for the stop.
pub struct Server {
    addr: SocketAddr,
    serving: Arc<AtomicBool>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::result::Result<(), tonic::transport::Error>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish()
    }
}

impl Server {
    /// Binds `opts.listen` and serves `backend` on the current tokio runtime until
    /// [`Server::shutdown`]. Returns once the socket is bound, so a client may connect at once.
    pub async fn start<B: Backend>(backend: Arc<B>, opts: &Options) -> Result<Server> {
        let bind = |source| Error::Bind {
            addr: opts.listen,
            source,
        };
        let listener = tokio::net::TcpListener::bind(opts.listen)
            .await
            .map_err(bind)?;
        let addr = listener.local_addr().map_err(bind)?;
        let serving = Arc::new(AtomicBool::new(true));
        let service =
            PolicyService::new(backend, opts.queue, opts.max_message_bytes, serving.clone());
        let svc = PolicyServer::new(service)
            .max_decoding_message_size(opts.max_message_bytes)
            .max_encoding_message_size(opts.max_message_bytes);
        let (stop, stopped) = oneshot::channel::<()>();
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let task = tokio::spawn(
            tonic::transport::Server::builder().serve_with_incoming_shutdown(
                svc,
                incoming,
                async move {
                    let _ = stopped.await;
                },
            ),
        );
        Ok(Server {
            addr,
            serving,
            stop: Some(stop),
            task,
        })
    }

    /// The address it listens on (the port chosen when `listen` asked for port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops gracefully: `Health` turns `NOT_SERVING`, no new connection is taken, the calls in
    /// flight finish and their replies are sent; returns when the last connection closed.
    pub async fn shutdown(mut self) -> Result<()> {
        self.serving.store(false, Ordering::SeqCst);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.task).await {
            Ok(r) => r.map_err(Error::Transport),
            Err(e) => Err(Error::Task(e.to_string())),
        }
    }

    /// Serves until `signal` completes, then shuts down gracefully; returns early with the
    /// error if the server fails first.
    pub async fn run_until(mut self, signal: impl Future<Output = ()>) -> Result<()> {
        tokio::select! {
            _ = signal => self.shutdown().await,
            r = &mut self.task => match r {
                Ok(r) => r.map_err(Error::Transport),
                Err(e) => Err(Error::Task(e.to_string())),
            },
        }
    }
}

/// Waits for the first SIGTERM or SIGINT (Ctrl-C) and completes with its name: what `petite
/// serve` stops on. The handlers are installed here, at the call (inside a tokio runtime), not
/// when the future is first polled: a signal that comes in between is not lost to its default
/// action (ending the process at once).
#[cfg(unix)]
pub fn termination() -> Result<impl Future<Output = &'static str>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).map_err(Error::Signal)?;
    let mut int = signal(SignalKind::interrupt()).map_err(Error::Signal)?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    })
}
