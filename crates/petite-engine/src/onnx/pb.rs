//! A minimal protobuf encoder: enough for ONNX's `ModelProto` (varints, length-delimited fields,
//! 32-bit floats). Encoding only; field numbers follow `onnx.proto` (opset-independent).

/// One message under construction.
#[derive(Debug, Default, Clone)]
pub struct Msg(pub Vec<u8>);

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

impl Msg {
    /// An empty message.
    pub fn new() -> Self {
        Msg(Vec::new())
    }

    fn key(&mut self, field: u32, wire: u8) {
        varint(&mut self.0, (u64::from(field) << 3) | u64::from(wire));
    }

    /// A varint field (int32/int64/enum; negative values as 10-byte two's complement).
    pub fn int(&mut self, field: u32, v: i64) -> &mut Self {
        self.key(field, 0);
        varint(&mut self.0, v as u64);
        self
    }

    /// A 32-bit float field.
    pub fn float(&mut self, field: u32, v: f32) -> &mut Self {
        self.key(field, 5);
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// A bytes/string field.
    pub fn bytes(&mut self, field: u32, b: &[u8]) -> &mut Self {
        self.key(field, 2);
        varint(&mut self.0, b.len() as u64);
        self.0.extend_from_slice(b);
        self
    }

    /// A string field.
    pub fn str(&mut self, field: u32, s: &str) -> &mut Self {
        self.bytes(field, s.as_bytes())
    }

    /// An embedded message field.
    pub fn msg(&mut self, field: u32, m: &Msg) -> &mut Self {
        self.bytes(field, &m.0)
    }

    /// A packed repeated varint field.
    pub fn packed_ints(&mut self, field: u32, vs: &[i64]) -> &mut Self {
        let mut body = Vec::new();
        for &v in vs {
            varint(&mut body, v as u64);
        }
        self.bytes(field, &body)
    }
}

fn varint_len(mut v: u64) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

/// The key and length prefix of a length-delimited field `field` whose body is `len` bytes:
/// what [`Msg::bytes`] writes before the body, for a body streamed after it.
pub fn field_header(field: u32, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(10);
    varint(&mut out, (u64::from(field) << 3) | 2);
    varint(&mut out, len as u64);
    out
}

/// Bytes of a length-delimited field `field` with a `len`-byte body, header included.
pub fn field_len(field: u32, len: usize) -> usize {
    varint_len((u64::from(field) << 3) | 2) + varint_len(len as u64) + len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_like_protobuf() {
        // Field 1 varint 150 → 08 96 01 (the protobuf documentation's example).
        assert_eq!(Msg::new().int(1, 150).0, [0x08, 0x96, 0x01]);
        // Field 2 string "testing" → 12 07 74 65 73 74 69 6e 67.
        assert_eq!(
            Msg::new().str(2, "testing").0,
            [0x12, 0x07, b't', b'e', b's', b't', b'i', b'n', b'g']
        );
        // Negative int64 takes 10 bytes.
        assert_eq!(Msg::new().int(1, -1).0.len(), 11);
        // Packed [3, 270] in field 4 → 22 03 03 8e 02.
        assert_eq!(
            Msg::new().packed_ints(4, &[3, 270]).0,
            [0x22, 0x03, 0x03, 0x8e, 0x02]
        );
        assert_eq!(Msg::new().float(2, 1.0).0, [0x15, 0, 0, 0x80, 0x3f]);
        // A streamed field's header + body is the nested message's encoding.
        for len in [0usize, 1, 127, 128, 300, 16_384, 2_097_152] {
            let body = vec![7u8; len];
            let whole = Msg::new().bytes(20, &body).0.clone();
            let mut streamed = field_header(20, len);
            streamed.extend_from_slice(&body);
            assert_eq!(streamed, whole, "{len}");
            assert_eq!(field_len(20, len), whole.len(), "{len}");
        }
    }
}
