//! A real single-node etcd for tests: 127.0.0.1, free ports, its data in tmpfs, killed and
//! removed on drop. The binary is `$KVXFER_ETCD_BIN` (the test command sets it, and then a
//! missing or broken etcd fails the tests) or `etcd` on the PATH (else the tests skip).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// How long etcd may take to answer after it starts.
const START_LIMIT: Duration = Duration::from_secs(30);

/// A running (or stopped) etcd.
pub struct EtcdServer {
    bin: PathBuf,
    dir: PathBuf,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// The etcd binary, or why the etcd tests are skipped. Panics when `KVXFER_ETCD_BIN` names
/// one that is not there: the test command promised it.
pub fn etcd_binary() -> Result<PathBuf, String> {
    if let Some(bin) = std::env::var_os("KVXFER_ETCD_BIN") {
        let bin = PathBuf::from(bin);
        assert!(
            bin.is_file(),
            "KVXFER_ETCD_BIN={} is not a file",
            bin.display()
        );
        return Ok(bin);
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "no etcd binary (set KVXFER_ETCD_BIN or install etcd-server; scripts/test.sh does)"
                .to_owned()
        })
}

/// A free port below Linux's ephemeral range (32768 and up), never handed out twice in this
/// process: one the kernel picked (port 0) may be taken by an outgoing connection between
/// its check and etcd's bind, and a restart reuses the same port.
fn free_port() -> u16 {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // Each process starts at its own offset, so parallel test binaries rarely meet.
    let offset = (std::process::id() % 600) * 20;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = u16::try_from(20_000 + (offset + n) % 12_000).expect("below 32768");
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

impl EtcdServer {
    /// Starts etcd and waits until it answers; `Err` is a reason to skip.
    pub fn start() -> Result<EtcdServer, String> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let bin = etcd_binary()?;
        let base = if std::path::Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let dir = base.join(format!(
            "kvxfer-etcd-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut s = EtcdServer {
            bin,
            dir,
            client_port: free_port(),
            peer_port: free_port(),
            child: None,
        };
        s.launch();
        Ok(s)
    }

    /// `etcd://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client_port)
    }

    /// SIGKILLs etcd (its data stays for [`EtcdServer::restart`]).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops (`true`, SIGSTOP) or resumes (`false`, SIGCONT) etcd: connections open, no
    /// answers, as a store that hangs.
    pub fn freeze(&mut self, frozen: bool) {
        if let Some(c) = &self.child {
            if let Ok(pid) = libc::pid_t::try_from(c.id()) {
                // SAFETY: a signal to our own child, which is alive (not yet waited for).
                unsafe { libc::kill(pid, if frozen { libc::SIGSTOP } else { libc::SIGCONT }) };
            }
        }
    }

    /// Starts etcd again on the same ports; `keep_data: false` starts it empty (a lost
    /// member), which loses every key and lease.
    pub fn restart(&mut self, keep_data: bool) {
        self.kill();
        if !keep_data {
            let _ = std::fs::remove_dir_all(self.dir.join("data"));
        }
        self.launch();
    }

    fn launch(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let log = std::fs::File::create(self.dir.join("etcd.log")).expect("etcd log file");
        let child = Command::new(&self.bin)
            .args(["--name", "kvxfer-test", "--data-dir"])
            .arg(self.dir.join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .arg(format!("--initial-cluster=kvxfer-test={peer}"))
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("etcd log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", self.bin.display()));
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let start = Instant::now();
        loop {
            let answered = std::net::TcpStream::connect(("127.0.0.1", self.client_port))
                .is_ok_and(|_| self.range_answers());
            if answered {
                return;
            }
            if let Some(Ok(Some(st))) = self.child.as_mut().map(Child::try_wait) {
                panic!("etcd exited ({st}) at start: {}", self.log());
            }
            assert!(
                start.elapsed() < START_LIMIT,
                "etcd did not answer in {START_LIMIT:?}: {}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn range_answers(&self) -> bool {
        kvxfer_discovery::etcd::EtcdClient::new(&self.url(), Duration::from_secs(1))
            .is_ok_and(|c| c.range_prefix(b"/").is_ok())
    }

    /// What etcd wrote to its log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
