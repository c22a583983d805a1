//! Fuzzes the `.pte` reader: any bytes must give `Ok` or a clear error, never a panic. Accepted
//! inputs must re-encode and decode to the same program (the reader and encoder agree).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((program, _layout)) = petite_pte::read_bytes(data) {
        let _ = petite_pte::summary::summarize(&program, &_layout).to_text();
        let fb = petite_pte::encode::encode_program(&program);
        let again = petite_pte::decode::decode_program(&fb).expect("re-encoded program decodes");
        // Compared as bytes (a NaN double is not equal to itself).
        assert_eq!(
            petite_pte::encode::encode_program(&again),
            fb,
            "re-encoding changed the program"
        );
    }
});
