//! A TCP proxy that can cut its traffic: an outage of whatever it fronts (the S3 store), made
//! on demand, and healed again.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

pub struct OutageProxy {
    pub addr: SocketAddr,
    up: watch::Sender<bool>,
    connections: Arc<Mutex<JoinSet<()>>>,
}

impl OutageProxy {
    pub async fn start(target: SocketAddr) -> OutageProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (up, watch_up) = watch::channel(true);
        let connections = Arc::new(Mutex::new(JoinSet::new()));
        let tracked = connections.clone();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !*watch_up.borrow() {
                    drop(client); // down: connections are accepted and closed at once
                    continue;
                }
                tracked.lock().unwrap().spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                });
            }
        });
        OutageProxy { addr, up, connections }
    }

    /// Drops every open connection and refuses new ones.
    pub fn cut(&self) {
        self.up.send_replace(false);
        self.connections.lock().unwrap().abort_all();
    }

    pub fn heal(&self) {
        self.up.send_replace(true);
    }
}
