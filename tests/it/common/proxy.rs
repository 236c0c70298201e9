//! A TCP proxy that can cut its traffic or freeze it: an outage of whatever it fronts (the S3
//! store), made on demand, and healed again; or move to another server, as a virtual address
//! follows a promoted database.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Up,
    /// Connections are accepted and closed at once.
    Cut,
    /// Connections are accepted and held open, and nothing is forwarded: a hung store.
    Frozen,
}

pub struct OutageProxy {
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    target: Arc<Mutex<SocketAddr>>,
    connections: Arc<Mutex<JoinSet<()>>>,
}

impl OutageProxy {
    pub async fn start(target: SocketAddr) -> OutageProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mode, watch_mode) = watch::channel(Mode::Up);
        let connections = Arc::new(Mutex::new(JoinSet::new()));
        let tracked = connections.clone();
        let target = Arc::new(Mutex::new(target));
        let followed = target.clone();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let now = *watch_mode.borrow();
                let target = *followed.lock().unwrap();
                let mut until_healed = watch_mode.clone();
                tracked.lock().unwrap().spawn(async move {
                    match now {
                        Mode::Cut => drop(client),
                        Mode::Frozen => {
                            let _ = until_healed.wait_for(|m| *m == Mode::Up).await;
                            drop(client);
                        }
                        Mode::Up => {
                            if let Ok(mut server) = TcpStream::connect(target).await {
                                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                            }
                        }
                    }
                });
            }
        });
        OutageProxy { addr, mode, target, connections }
    }

    /// Drops every open connection and refuses new ones.
    pub fn cut(&self) {
        self.set(Mode::Cut);
    }

    /// Drops every open connection; new ones are accepted and never answered.
    pub fn freeze(&self) {
        self.set(Mode::Frozen);
    }

    /// Drops every open connection; new ones go to `target`, and are forwarded.
    pub fn move_to(&self, target: SocketAddr) {
        *self.target.lock().unwrap() = target;
        self.set(Mode::Up);
    }

    pub fn heal(&self) {
        self.mode.send_replace(Mode::Up);
    }

    fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
        self.connections.lock().unwrap().abort_all();
    }
}
