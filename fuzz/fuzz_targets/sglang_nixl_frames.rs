//! SGLang's nixl backend's ZMQ messages (`kvxfer_core::wire::sglang_nixl`), as a stock
//! decode sends them to a kvxfer prefill and a stock prefill answers a kvxfer decode: any
//! frames decode either way without panicking, and what decodes as a registration or a room
//! encodes to frames that decode to it again.
#![no_main]
use kvxfer_core::wire::sglang_nixl::{
    FromDecode, GUARD, decode, decode_from_prefill, encode_registration, encode_room,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Frames separated by 0xFF; a leading 0 byte starts them with SGLang's guard and a
    // registration's "None", so the fuzzer reaches the field decoders quickly.
    let (lead, rest): (Vec<&[u8]>, &[u8]) = match data.split_first() {
        Some((0, rest)) => (vec![GUARD, b"None"], rest),
        Some((1, rest)) => (vec![GUARD], rest),
        _ => (Vec::new(), data),
    };
    let mut frames = lead;
    frames.extend(rest.split(|&b| b == 0xFF));
    let _ = decode_from_prefill(&frames);
    let Ok(msg) = decode(&frames) else {
        return;
    };
    let again = match &msg {
        FromDecode::Register(r) => encode_registration(r),
        FromDecode::Room(r) => encode_room(r),
        FromDecode::Abort(_) => return,
    };
    let parts: Vec<&[u8]> = again.iter().map(Vec::as_slice).collect();
    assert_eq!(
        decode(&parts).as_ref(),
        Ok(&msg),
        "re-encoded frames decode otherwise"
    );
});
