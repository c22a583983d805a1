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
    }
}
