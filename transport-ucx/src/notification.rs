//! Notifications on the wire: one eager active message `[name length u16 LE][name][message]`.
//! The decoder is fed bytes from the network: bounded, never panics.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects))]

use kvxfer_core::Notification;

/// Encodes a notification for the wire.
pub fn encode_notification(from: &str, message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(from.len().saturating_add(message.len()).saturating_add(2));
    out.extend_from_slice(&(from.len() as u16).to_le_bytes());
    out.extend_from_slice(from.as_bytes());
    out.extend_from_slice(message);
    out
}

/// Decodes a notification from the wire (bounded, never panics).
pub fn decode_notification(bytes: &[u8], max_len: usize) -> Option<Notification> {
    let n = u16::from_le_bytes([*bytes.first()?, *bytes.get(1)?]) as usize;
    let (name, message) = bytes.get(2..)?.split_at_checked(n)?;
    if n == 0 || message.len() > max_len {
        return None;
    }
    Some(Notification {
        from: std::str::from_utf8(name).ok()?.to_string(),
        message: message.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notification_codec() {
        let b = encode_notification("decode-1", b"done:req-7");
        let n = decode_notification(&b, 64).unwrap();
        assert_eq!(
            (n.from.as_str(), n.message.as_slice()),
            ("decode-1", &b"done:req-7"[..])
        );
        assert!(decode_notification(&b, 4).is_none(), "over the limit");
        for cut in 0..10 {
            assert!(decode_notification(&b[..cut], 64).is_none());
        }
        assert!(
            decode_notification(&[0, 0, 1], 64).is_none(),
            "empty sender"
        );
        assert!(decode_notification(&[0xff, 0xff], 64).is_none());
    }
}
