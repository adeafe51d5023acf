//! The options of kvxfer's vLLM connectors (`kv_connector_extra_config`), read once: every
//! key, its type, its default and its bounds live here, and the Python connectors take the
//! whole validated set from [`ConnectorOptions::parse`]. A key the connector does not know
//! is refused by name, so that a typo fails engine start instead of leaving a default in
//! place unnoticed.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use std::time::Duration;

use serde::Serialize;
use serde_json::{Map, Value};

use crate::pull::PullConfig;
use crate::push::PushDecodeConfig;

/// Which connector reads the options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    /// `KvxferConnector`: the decode READs.
    Pull,
    /// `KvxferPushConnector`: the prefill WRITEs.
    Push,
}

impl Flow {
    /// The connector's class name, for messages.
    pub fn connector(self) -> &'static str {
        match self {
            Flow::Pull => "KvxferConnector",
            Flow::Push => "KvxferPushConnector",
        }
    }

    /// The keys this connector reads.
    pub fn keys(self) -> &'static [&'static str] {
        match self {
            Flow::Pull => &PULL_KEYS,
            Flow::Push => &PUSH_KEYS,
        }
    }
}

const PULL_KEYS: [&str; 16] = [
    "transport",
    "ucx_library",
    "side_channel_host",
    "side_channel_port",
    "idle_wait",
    "lease",
    "transfer_timeout",
    "handshake_timeout",
    "enforce_compat",
    "digest",
    "vllm_peers",
    "enforce_handshake_compat",
    "stop_short",
    "discovery",
    "cluster",
    "lease_ttl",
];
const PUSH_KEYS: [&str; 9] = [
    "transport",
    "ucx_library",
    "side_channel_host",
    "side_channel_port",
    "idle_wait",
    "bootstrap_timeout",
    "waiting_timeout",
    "layerwise",
    "layerwise_min_tokens",
];

/// Below this many prompt tokens the push prefill sends a prompt's pages whole after its
/// step instead of layer by layer (measured: docs/vllm.md, "The push flow").
pub const LAYERWISE_MIN_TOKENS: u64 = 48;

/// Longest timeout or lease accepted, in seconds (a day): longer is a unit mistake.
const MAX_SECONDS: f64 = 86_400.0;

/// Every option of both connectors, with its value or default. Keys of the other connector
/// keep their defaults (and are refused if given).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ConnectorOptions {
    /// `ucx` or `nixl`.
    pub transport: String,
    /// Which UCX library (`auto`, `system`, `nixl`, or a path).
    pub ucx_library: String,
    /// Host the side channel binds.
    pub side_channel_host: String,
    /// Base port of the side channel (0: a free one).
    pub side_channel_port: u16,
    /// Seconds an idle engine step waits for transfers to finish (0 to 1).
    pub idle_wait: f64,
    /// Pull: seconds a prefill holds unread blocks without hearing from the decode.
    pub lease: f64,
    /// Pull: seconds before a READ in progress is cancelled and its load failed.
    pub transfer_timeout: f64,
    /// Pull: bound on each side-channel wait, in seconds.
    pub handshake_timeout: f64,
    /// Pull: refuse peers whose layout does not fit.
    pub enforce_compat: bool,
    /// Pull: check every load's bytes against digests the prefill computed.
    pub digest: bool,
    /// Pull: speak vLLM's NixlConnector handshake to stock engines too.
    pub vllm_peers: bool,
    /// Pull: refuse stock peers whose compatibility hash differs.
    pub enforce_handshake_compat: bool,
    /// Pull: with a sliding window, stop the prefill before the last prompt token.
    pub stop_short: bool,
    /// Pull: `etcd://HOST:PORT[,...]` to register in, none by default.
    pub discovery: Option<String>,
    /// Pull: the discovery key prefix.
    pub cluster: String,
    /// Pull: seconds of the discovery lease.
    pub lease_ttl: f64,
    /// Push: seconds either side waits for the other to show up for a request.
    pub bootstrap_timeout: f64,
    /// Push: the decode's bound on a whole room, in seconds.
    pub waiting_timeout: f64,
    /// Push: stream each layer's pages as it is computed.
    pub layerwise: bool,
    /// Push: prompts shorter than this go whole after their step.
    pub layerwise_min_tokens: u64,
}

impl Default for ConnectorOptions {
    fn default() -> Self {
        let pull = PullConfig::new("", 0, 1);
        let push = PushDecodeConfig::new(0, 1);
        ConnectorOptions {
            transport: "ucx".into(),
            ucx_library: "auto".into(),
            side_channel_host: pull.side_channel_host,
            side_channel_port: pull.side_channel_port,
            idle_wait: 0.005,
            lease: pull.lease.as_secs_f64(),
            transfer_timeout: pull.transfer_timeout.as_secs_f64(),
            handshake_timeout: pull.handshake_timeout.as_secs_f64(),
            enforce_compat: pull.enforce_compat,
            digest: pull.digest,
            vllm_peers: true,
            enforce_handshake_compat: true,
            stop_short: true,
            discovery: None,
            cluster: "default".into(),
            lease_ttl: 10.0,
            bootstrap_timeout: push.bootstrap_timeout.as_secs_f64(),
            waiting_timeout: push.waiting_timeout.as_secs_f64(),
            layerwise: true,
            layerwise_min_tokens: LAYERWISE_MIN_TOKENS,
        }
    }
}

impl ConnectorOptions {
    /// Reads `kv_connector_extra_config` (a JSON object; `null` is none) for `flow`: each key
    /// checked for its type and bounds, an unknown key refused naming it and the keys the
    /// connector knows. Booleans are JSON's or the strings `true`/`false` (a command line's).
    pub fn parse(json: &str, flow: Flow) -> Result<Self, String> {
        let value: Value = serde_json::from_str(json)
            .map_err(|e| format!("kv_connector_extra_config is not JSON: {e}"))?;
        let map = match value {
            Value::Null => Map::new(),
            Value::Object(m) => m,
            other => {
                return Err(format!(
                    "kv_connector_extra_config: expected an object, got {other}"
                ));
            }
        };
        let mut o = ConnectorOptions::default();
        for (key, v) in &map {
            if !flow.keys().contains(&key.as_str()) {
                return Err(unknown(key, flow));
            }
            let bad =
                |want: &str| format!("kv_connector_extra_config {key:?}: expected {want}, got {v}");
            match key.as_str() {
                "transport" => {
                    o.transport = string(v).ok_or_else(|| bad("\"ucx\" or \"nixl\""))?;
                    if !matches!(o.transport.as_str(), "ucx" | "nixl") {
                        return Err(bad("\"ucx\" or \"nixl\""));
                    }
                }
                "ucx_library" => o.ucx_library = string(v).ok_or_else(|| bad("a string"))?,
                "side_channel_host" => {
                    o.side_channel_host = string(v)
                        .filter(|h| !h.is_empty())
                        .ok_or_else(|| bad("a host name or address"))?;
                }
                "side_channel_port" => {
                    o.side_channel_port = v
                        .as_u64()
                        .and_then(|p| u16::try_from(p).ok())
                        .ok_or_else(|| bad("a port, 0 to 65535"))?;
                }
                "idle_wait" => {
                    o.idle_wait = seconds(v, 0.0, 1.0).ok_or_else(|| bad("0 to 1 seconds"))?;
                }
                "discovery" => {
                    o.discovery = match v {
                        Value::Null => None,
                        _ => Some(string(v).ok_or_else(|| bad("an etcd:// URL"))?),
                    };
                }
                "cluster" => {
                    o.cluster = string(v)
                        .filter(|c| !c.is_empty())
                        .ok_or_else(|| bad("a name"))?;
                }
                "lease_ttl" => {
                    o.lease_ttl =
                        seconds(v, 2.0, 3600.0).ok_or_else(|| bad("2 to 3600 seconds"))?;
                }
                "layerwise_min_tokens" => {
                    o.layerwise_min_tokens = v
                        .as_u64()
                        .filter(|&n| n <= u64::from(u32::MAX))
                        .ok_or_else(|| bad("a token count"))?;
                }
                k => {
                    if let Some(slot) = o.timeout(k) {
                        *slot = seconds(v, f64::MIN_POSITIVE, MAX_SECONDS)
                            .ok_or_else(|| bad("seconds above 0, at most a day"))?;
                    } else if let Some(slot) = o.flag(k) {
                        *slot = flag(v).ok_or_else(|| bad("true or false"))?;
                    }
                }
            }
        }
        Ok(o)
    }

    /// A pull worker's settings as these options give them, over `config`'s: its side
    /// channel, lease (and the heartbeat with it), transfer and handshake timeouts,
    /// compatibility enforcement and content digests. The one place the connector's options
    /// become a [`PullConfig`]; a duration these options cannot hold keeps `config`'s.
    pub fn pull_config(&self, config: PullConfig) -> PullConfig {
        let secs = |s: f64, or: Duration| Duration::try_from_secs_f64(s).unwrap_or(or);
        let lease = secs(self.lease, config.lease);
        let mut c = config.with_lease(lease);
        c.side_channel_host = self.side_channel_host.clone();
        c.side_channel_port = self.side_channel_port;
        c.transfer_timeout = secs(self.transfer_timeout, c.transfer_timeout);
        c.handshake_timeout = secs(self.handshake_timeout, c.handshake_timeout);
        c.enforce_compat = self.enforce_compat;
        c.digest = self.digest;
        c
    }

    /// The options as JSON (every key, defaults filled in).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    fn timeout(&mut self, key: &str) -> Option<&mut f64> {
        Some(match key {
            "lease" => &mut self.lease,
            "transfer_timeout" => &mut self.transfer_timeout,
            "handshake_timeout" => &mut self.handshake_timeout,
            "bootstrap_timeout" => &mut self.bootstrap_timeout,
            "waiting_timeout" => &mut self.waiting_timeout,
            _ => return None,
        })
    }

    fn flag(&mut self, key: &str) -> Option<&mut bool> {
        Some(match key {
            "enforce_compat" => &mut self.enforce_compat,
            "digest" => &mut self.digest,
            "vllm_peers" => &mut self.vllm_peers,
            "enforce_handshake_compat" => &mut self.enforce_handshake_compat,
            "stop_short" => &mut self.stop_short,
            "layerwise" => &mut self.layerwise,
            _ => return None,
        })
    }
}

fn unknown(key: &str, flow: Flow) -> String {
    let other = match flow {
        Flow::Pull => Flow::Push,
        Flow::Push => Flow::Pull,
    };
    let hint = if other.keys().contains(&key) {
        format!(" ({key:?} is a {} key)", other.connector())
    } else {
        String::new()
    };
    format!(
        "kv_connector_extra_config: unknown key {key:?} for {}{hint}; it reads {}",
        flow.connector(),
        flow.keys().join(", ")
    )
}

fn string(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

fn flag(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        Value::String(s) if s.eq_ignore_ascii_case("true") => Some(true),
        Value::String(s) if s.eq_ignore_ascii_case("false") => Some(false),
        _ => None,
    }
}

/// A number of seconds within `lo..=hi` (NaN and infinities refused).
fn seconds(v: &Value, lo: f64, hi: f64) -> Option<f64> {
    v.as_f64()
        .filter(|s| s.is_finite() && (lo..=hi).contains(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The worker's settings come from the options, defaults and all; nothing else changes.
    #[test]
    fn the_pull_workers_settings_come_from_the_options() {
        let base = PullConfig::new("e", 1, 2);
        let same = ConnectorOptions::default().pull_config(base.clone());
        assert_eq!(
            format!("{same:?}"),
            format!("{base:?}"),
            "defaults are the core's"
        );
        let o = ConnectorOptions::parse(
            r#"{"side_channel_host": "10.0.0.1", "side_channel_port": 0, "lease": 12,
                "transfer_timeout": 7.5, "handshake_timeout": 2, "enforce_compat": false,
                "digest": true}"#,
            Flow::Pull,
        )
        .unwrap();
        let c = o.pull_config(base.clone());
        assert_eq!(
            (c.side_channel_host.as_str(), c.side_channel_port),
            ("10.0.0.1", 0)
        );
        assert_eq!(
            (c.lease, c.heartbeat_interval),
            (Duration::from_secs(12), Duration::from_secs(2))
        );
        assert_eq!(c.transfer_timeout, Duration::from_millis(7500));
        assert_eq!(c.handshake_timeout, Duration::from_secs(2));
        assert!(!c.enforce_compat && c.digest);
        assert_eq!((c.engine_id.as_str(), c.tp_rank, c.tp_size), ("e", 1, 2));
        // Values no duration holds (only a caller filling the fields itself can make them)
        // keep the config's.
        let bad = ConnectorOptions {
            lease: -1.0,
            transfer_timeout: f64::NAN,
            handshake_timeout: f64::INFINITY,
            ..ConnectorOptions::default()
        };
        let c = bad.pull_config(base.clone());
        assert_eq!(
            (c.lease, c.transfer_timeout, c.handshake_timeout),
            (base.lease, base.transfer_timeout, base.handshake_timeout)
        );
    }

    #[test]
    fn defaults_are_the_connectors_own() {
        let o = ConnectorOptions::parse("{}", Flow::Pull).unwrap();
        assert_eq!(o, ConnectorOptions::default());
        assert_eq!(ConnectorOptions::parse("null", Flow::Push).unwrap(), o);
        assert_eq!(
            (
                o.side_channel_port,
                o.lease,
                o.transfer_timeout,
                o.handshake_timeout
            ),
            (5600, 30.0, 30.0, 5.0)
        );
        assert_eq!((o.bootstrap_timeout, o.waiting_timeout), (30.0, 300.0));
        assert_eq!(o.layerwise_min_tokens, 48);
        assert!(o.vllm_peers && o.stop_short && o.layerwise && !o.digest);
        assert_eq!(o.transport, "ucx");
        let back: Value = serde_json::from_str(&o.to_json()).unwrap();
        let keys: Vec<&String> = back.as_object().unwrap().keys().collect();
        for k in PULL_KEYS.iter().chain(&PUSH_KEYS) {
            assert!(keys.iter().any(|x| x == k), "{k} missing from the JSON");
        }
    }

    #[test]
    fn every_key_is_read_with_its_type() {
        let o = ConnectorOptions::parse(
            r#"{"transport": "nixl", "ucx_library": "system", "side_channel_host": "10.0.0.1",
                "side_channel_port": 0, "idle_wait": 0, "lease": 600, "transfer_timeout": 0.5,
                "handshake_timeout": 150, "enforce_compat": false, "digest": "TRUE",
                "vllm_peers": "false", "enforce_handshake_compat": false, "stop_short": false,
                "discovery": "etcd://h:2379", "cluster": "c", "lease_ttl": 2}"#,
            Flow::Pull,
        )
        .unwrap();
        assert_eq!(
            (
                o.transport.as_str(),
                o.ucx_library.as_str(),
                o.side_channel_host.as_str()
            ),
            ("nixl", "system", "10.0.0.1")
        );
        assert_eq!((o.side_channel_port, o.idle_wait, o.lease), (0, 0.0, 600.0));
        assert_eq!((o.transfer_timeout, o.handshake_timeout), (0.5, 150.0));
        assert!(!o.enforce_compat && o.digest && !o.vllm_peers);
        assert!(!o.enforce_handshake_compat && !o.stop_short);
        assert_eq!(o.discovery.as_deref(), Some("etcd://h:2379"));
        assert_eq!((o.cluster.as_str(), o.lease_ttl), ("c", 2.0));
        let p = ConnectorOptions::parse(
            r#"{"bootstrap_timeout": 3, "waiting_timeout": 15, "layerwise": false,
                "layerwise_min_tokens": 0, "side_channel_port": 65535}"#,
            Flow::Push,
        )
        .unwrap();
        assert_eq!((p.bootstrap_timeout, p.waiting_timeout), (3.0, 15.0));
        assert_eq!(
            (p.layerwise, p.layerwise_min_tokens, p.side_channel_port),
            (false, 0, 65535)
        );
        let d = ConnectorOptions::parse(r#"{"discovery": null}"#, Flow::Pull).unwrap();
        assert_eq!(d.discovery, None);
    }

    #[test]
    fn an_unknown_key_is_refused_by_name() {
        let e = ConnectorOptions::parse(r#"{"lease": 5, "leese": 5}"#, Flow::Pull).unwrap_err();
        assert!(
            e.contains("unknown key \"leese\" for KvxferConnector") && e.contains("lease_ttl"),
            "{e}"
        );
        // The other connector's key is named as such.
        let e = ConnectorOptions::parse(r#"{"layerwise": true}"#, Flow::Pull).unwrap_err();
        assert!(
            e.contains("\"layerwise\" is a KvxferPushConnector key"),
            "{e}"
        );
        let e = ConnectorOptions::parse(r#"{"lease": 600}"#, Flow::Push).unwrap_err();
        assert!(e.contains("\"lease\" is a KvxferConnector key"), "{e}");
    }

    #[test]
    fn values_of_the_wrong_type_or_out_of_bounds_are_refused_naming_the_key() {
        let cases = [
            (r#"{"transport": "tcp"}"#, "\"transport\""),
            (r#"{"transport": 1}"#, "\"transport\""),
            (r#"{"side_channel_port": 65536}"#, "a port"),
            (r#"{"side_channel_port": -1}"#, "a port"),
            (r#"{"side_channel_port": "5600"}"#, "a port"),
            (r#"{"side_channel_host": ""}"#, "\"side_channel_host\""),
            (r#"{"idle_wait": 1.5}"#, "0 to 1 seconds"),
            (r#"{"idle_wait": -0.1}"#, "0 to 1 seconds"),
            (r#"{"lease": 0}"#, "\"lease\""),
            (r#"{"lease": -3}"#, "\"lease\""),
            (r#"{"transfer_timeout": 1e9}"#, "at most a day"),
            (r#"{"handshake_timeout": "5"}"#, "\"handshake_timeout\""),
            (r#"{"digest": 1}"#, "true or false"),
            (r#"{"stop_short": "yes"}"#, "true or false"),
            (r#"{"discovery": 5}"#, "\"discovery\""),
            (r#"{"cluster": ""}"#, "\"cluster\""),
            (r#"{"lease_ttl": 1}"#, "2 to 3600"),
            ("[]", "expected an object"),
            ("{", "not JSON"),
        ];
        for (json, want) in cases {
            let e = ConnectorOptions::parse(json, Flow::Pull).unwrap_err();
            assert!(e.contains(want), "{json}: {e}");
        }
        for (json, want) in [
            (r#"{"layerwise_min_tokens": -1}"#, "a token count"),
            (r#"{"layerwise_min_tokens": 1.5}"#, "a token count"),
            (r#"{"layerwise_min_tokens": 4294967296}"#, "a token count"),
            (r#"{"waiting_timeout": null}"#, "\"waiting_timeout\""),
            (r#"{"layerwise": null}"#, "true or false"),
        ] {
            let e = ConnectorOptions::parse(json, Flow::Push).unwrap_err();
            assert!(e.contains(want), "{json}: {e}");
        }
    }
}
