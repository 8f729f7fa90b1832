//! The safetensors header: parsed from the first bytes of an object, and
//! checked against the object's real size before any tensor is trusted.

use safetensors::Dtype;
use safetensors::tensor::Metadata;

/// Bytes of the little-endian header length that starts every file.
pub const LEN_PREFIX: u64 = 8;
/// The largest header accepted. safetensors itself allows 100 MB; real
/// checkpoints have headers of a few hundred KiB, so 100 MiB is generous
/// and still bounds what a lying file can make us allocate.
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// One tensor's place in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// Its name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Absolute byte range in the object.
    pub start: u64,
    /// End of the range (exclusive).
    pub end: u64,
}

/// A parsed and checked safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Length of the JSON header in bytes.
    pub json_len: u64,
    /// Tensors in file order.
    pub tensors: Vec<TensorEntry>,
}

impl Header {
    /// Where tensor data starts.
    pub fn data_start(&self) -> u64 {
        LEN_PREFIX + self.json_len
    }

    /// Where tensor data ends: the object's expected size.
    pub fn data_end(&self) -> u64 {
        self.tensors.last().map_or(self.data_start(), |t| t.end)
    }
}

/// Reads the JSON length from the first 8 bytes, refusing lengths that
/// cannot fit in the object or exceed `max`.
pub fn json_len(prefix: &[u8], object_size: u64, max: u64) -> Result<u64, String> {
    let bytes: [u8; 8] = prefix
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| {
            format!("the object is {object_size} bytes, too short for a safetensors header")
        })?;
    let n = u64::from_le_bytes(bytes);
    if n > max {
        return Err(format!(
            "the header claims {n} bytes, over the limit of {max}"
        ));
    }
    if n.checked_add(LEN_PREFIX)
        .is_none_or(|end| end > object_size)
    {
        return Err(format!(
            "the header claims {n} bytes but the object is only {object_size} bytes (truncated?)"
        ));
    }
    Ok(n)
}

/// Parses the JSON header and checks every tensor against `object_size`:
/// offsets in order without gaps or overlaps, sizes matching dtype and
/// shape without overflow, and the data ending exactly at the object's end.
pub fn parse(json: &[u8], object_size: u64) -> Result<Header, String> {
    let json_len = json.len() as u64;
    let text = std::str::from_utf8(json).map_err(|e| format!("the header is not UTF-8: {e}"))?;
    // `Metadata`'s deserializer sorts by offset and rejects gaps, overlaps,
    // overflowing shapes and sizes that do not match the dtype.
    let meta: Metadata =
        serde_json::from_str(text).map_err(|e| format!("the header is not valid: {e}"))?;
    let data_start = LEN_PREFIX + json_len;
    let data_len = meta.data_len() as u64;
    let expected = data_start
        .checked_add(data_len)
        .ok_or_else(|| "the header's offsets overflow".to_string())?;
    if expected != object_size {
        return Err(if expected > object_size {
            format!(
                "the header describes {data_len} bytes of tensor data but the object holds {} (truncated)",
                object_size.saturating_sub(data_start)
            )
        } else {
            format!(
                "the object has {} bytes after the tensor data the header describes",
                object_size - expected
            )
        });
    }
    let infos = meta.tensors();
    let mut tensors = Vec::with_capacity(infos.len());
    for name in meta.offset_keys() {
        let info = infos
            .get(&name)
            .ok_or_else(|| format!("tensor {name:?} is listed but has no entry"))?;
        let (s, e) = info.data_offsets;
        tensors.push(TensorEntry {
            name,
            dtype: info.dtype,
            shape: info.shape.clone(),
            start: data_start + s as u64,
            end: data_start + e as u64,
        });
    }
    Ok(Header { json_len, tensors })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A well-formed file: header plus zeroed tensor data.
    pub(crate) fn file(tensors: &[(&str, &str, &[usize])]) -> Vec<u8> {
        let mut off = 0usize;
        let mut entries = Vec::new();
        for (name, dtype, shape) in tensors {
            let size = match *dtype {
                "F32" | "I32" => 4,
                "F16" | "BF16" => 2,
                _ => 1,
            } * shape.iter().product::<usize>();
            entries.push(format!(
                "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":{shape:?},\"data_offsets\":[{off},{}]}}",
                off + size
            ));
            off += size;
        }
        let json = format!("{{{}}}", entries.join(","));
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(json.as_bytes());
        out.resize(out.len() + off, 0);
        out
    }

    fn parse_file(bytes: &[u8]) -> Result<Header, String> {
        let n = json_len(bytes, bytes.len() as u64, MAX_HEADER_BYTES)?;
        let json = bytes
            .get(8..8 + n as usize)
            .ok_or_else(|| "short".to_string())?;
        parse(json, bytes.len() as u64)
    }

    #[test]
    fn a_good_file_parses_in_offset_order() {
        let f = file(&[("b", "F32", &[2, 3]), ("a", "F16", &[4])]);
        let h = parse_file(&f).expect("valid");
        assert_eq!(h.tensors[0].name, "b");
        assert_eq!(h.tensors[0].shape, vec![2, 3]);
        assert_eq!(h.tensors[0].end - h.tensors[0].start, 24);
        assert_eq!(h.tensors[1].name, "a");
        assert_eq!(h.data_end(), f.len() as u64);
    }

    #[test]
    fn lies_are_refused_with_a_reason() {
        let f = file(&[("w", "F32", &[4])]);
        // Truncated data.
        let err = parse_file(&f[..f.len() - 1]).unwrap_err();
        assert!(err.contains("truncated"), "{err}");
        // Extra trailing bytes.
        let mut long = f.clone();
        long.push(0);
        assert!(
            parse_file(&long)
                .unwrap_err()
                .contains("after the tensor data")
        );
        // Header length beyond the object.
        let mut big = f.clone();
        big[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
        assert!(parse_file(&big).unwrap_err().contains("over the limit"));
        let mut over = f.clone();
        over[..8].copy_from_slice(&(f.len() as u64).to_le_bytes());
        assert!(parse_file(&over).unwrap_err().contains("only"));
        // Overlapping and mis-sized tensors.
        let json = br#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
        assert!(parse(json, 8 + json.len() as u64 + 12).is_err());
        let json = br#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        assert!(parse(json, 8 + json.len() as u64 + 8).is_err());
        let json =
            br#"{"a":{"dtype":"F32","shape":[18446744073709551615,2],"data_offsets":[0,8]}}"#;
        assert!(parse(json, 8 + json.len() as u64 + 8).is_err());
        assert!(parse(b"not json", 100).is_err());
        assert!(json_len(b"\x01\x02", 2, MAX_HEADER_BYTES).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Arbitrary bytes never panic, and a header that passes always
        /// describes ranges inside the object.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(h) = parse_file(&bytes) {
                for t in &h.tensors {
                    prop_assert!(t.start <= t.end && t.end <= bytes.len() as u64);
                }
            }
        }

        /// Mutating one byte of a valid file either still parses to ranges
        /// inside the object or gives an error, never a panic.
        #[test]
        fn mutated_headers_never_panic(pos in 0usize..200, byte in any::<u8>()) {
            let mut f = file(&[("layer.0.weight", "F32", &[3, 5]), ("layer.0.bias", "BF16", &[5])]);
            let p = pos % f.len();
            f[p] = byte;
            if let Ok(h) = parse_file(&f) {
                prop_assert_eq!(h.data_end(), f.len() as u64);
            }
        }
    }
}
