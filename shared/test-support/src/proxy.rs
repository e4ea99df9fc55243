//! A TCP proxy between the fleet and a service (LocalStack, RabbitMQ) that a test can freeze (bytes
//! stop flowing both ways, connections stay open: a service that hangs, as under SIGSTOP), thaw, or
//! cut (every connection dropped, the port closed), without touching the shared service itself.

use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

pub struct Proxy {
    pub port: u16,
    target: String,
    frozen: watch::Sender<bool>,
    tasks: Arc<Mutex<JoinSet<()>>>,
}

impl Proxy {
    /// Listens on `port` (0: any) and forwards to `target` (`host:port`).
    pub async fn start(port: u16, target: &str) -> Proxy {
        let listener = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let tasks: Arc<Mutex<JoinSet<()>>> = Arc::default();
        let (frozen, _) = watch::channel(false);
        let p = Proxy { port, target: target.to_string(), frozen, tasks };
        let (conns, target, frozen) = (p.tasks.clone(), p.target.clone(), p.frozen.clone());
        p.tasks.lock().unwrap().spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else { return };
                let (target, frozen) = (target.clone(), frozen.clone());
                conns.lock().unwrap().spawn(async move {
                    let Ok(server) = TcpStream::connect(&target).await else { return };
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::join!(pipe(cr, sw, frozen.subscribe()), pipe(sr, cw, frozen.subscribe()));
                });
            }
        });
        p
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Stops every byte, both ways, until `thaw`.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    pub fn thaw(&self) {
        self.frozen.send_replace(false);
    }

    /// Drops every connection and stops listening.
    pub fn cut(&self) {
        let set = std::mem::take(&mut *self.tasks.lock().unwrap());
        drop(set);
    }
}

/// Copies `from` to `to`, holding what it read while frozen.
async fn pipe(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, mut frozen: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.wait_for(|f| !*f).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
