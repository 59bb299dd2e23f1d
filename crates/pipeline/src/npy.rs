//! The one `.npy` layout the vision encoder's input comes in: a C-order little-endian f32
//! array, parsed from untrusted bytes. Outside the `vision` feature so that its fuzz target
//! (`crates/pipeline/fuzz`, `npy`) builds without wgpu.

/// The most bytes of a `.npy` header [`parse_pixels_npy`] reads (numpy writes 128).
pub(crate) const NPY_HEADER_MAX: usize = 64 << 10;

/// A `3 x size x size` f32 array (leading dimensions of 1 allowed) from a `.npy` file's bytes:
/// the parser of `vision::read_pixels_npy`. It reads the one layout numpy writes for a C-order
/// little-endian f32 array (`{'descr': '<f4', 'fortran_order': False, 'shape': (...), }`) with a
/// strict single-pass parser: the header's length, keys and shape are checked before anything
/// is allocated for the values. (It once went through npyz, whose header parser `cargo xtask
/// fuzz` found allocating 3 GB for a 150-byte file and backtracking for minutes on 300 bytes of
/// nested brackets.)
///
/// # Errors
/// What is wrong with the bytes, in words.
pub fn parse_pixels_npy(bytes: &[u8], size: usize) -> Result<Vec<f32>, String> {
    let (header_start, header_len) = match bytes {
        [0x93, b'N', b'U', b'M', b'P', b'Y', 1, _, a, b, ..] => {
            (10, usize::from(u16::from_le_bytes([*a, *b])))
        }
        [0x93, b'N', b'U', b'M', b'P', b'Y', 2 | 3, _, a, b, c, d, ..] => {
            (12, u32::from_le_bytes([*a, *b, *c, *d]) as usize)
        }
        _ => return Err("not a .npy file (no \\x93NUMPY magic with version 1, 2 or 3)".into()),
    };
    if header_len > NPY_HEADER_MAX || header_start + header_len > bytes.len() {
        return Err(format!(
            "the .npy header claims {header_len} bytes (the file has {}, at most {NPY_HEADER_MAX} \
             are read)",
            bytes.len()
        ));
    }
    let header = std::str::from_utf8(&bytes[header_start..header_start + header_len])
        .map_err(|_| "the .npy header is not text".to_string())?;
    let shape = npy_header_shape(header)?;
    let want = [3, size, size];
    let tail: Vec<usize> = shape.iter().rev().take(3).rev().copied().collect();
    if tail != want || shape.iter().rev().skip(3).any(|&d| d != 1) {
        return Err(format!("shape {shape:?}, the tower takes 3x{size}x{size}"));
    }
    let data = &bytes[header_start + header_len..];
    let count = 3 * size * size;
    if data.len() != count * 4 {
        return Err(format!(
            "{} bytes of values, a 3x{size}x{size} f32 array has {}",
            data.len(),
            count * 4
        ));
    }
    Ok(data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// The shape of a `.npy` header that describes a C-order little-endian f32 array; anything
/// else is an error naming what differs.
fn npy_header_shape(header: &str) -> Result<Vec<usize>, String> {
    let body = header
        .trim()
        .strip_prefix('{')
        .and_then(|b| b.strip_suffix('}'))
        .ok_or("the .npy header is not a {...} dictionary")?;
    // Split at commas outside the shape's parentheses (no nesting is valid here).
    let mut items = Vec::new();
    let (mut depth, mut from) = (0u32, 0);
    for (i, c) in body.char_indices() {
        match c {
            '(' if depth == 0 => depth = 1,
            '(' => return Err("nested parentheses in the .npy header".into()),
            ')' if depth == 1 => depth = 0,
            ')' => return Err("an unmatched ')' in the .npy header".into()),
            ',' if depth == 0 => {
                items.push(&body[from..i]);
                from = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("an unclosed '(' in the .npy header".into());
    }
    items.push(&body[from..]);
    let unquote = |s: &str| {
        let s = s.trim();
        s.strip_prefix('\'')
            .and_then(|s| s.strip_suffix('\''))
            .or_else(|| s.strip_prefix('"').and_then(|s| s.strip_suffix('"')))
            .map(str::to_owned)
    };
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    for item in items.iter().filter(|i| !i.trim().is_empty()) {
        let (key, value) = item
            .split_once(':')
            .ok_or_else(|| format!("`{}` in the .npy header is not key: value", item.trim()))?;
        match unquote(key).as_deref() {
            Some("descr") => descr = unquote(value),
            Some("fortran_order") => fortran = Some(value.trim() == "True"),
            Some("shape") => {
                let dims = value
                    .trim()
                    .strip_prefix('(')
                    .and_then(|v| v.strip_suffix(')'))
                    .ok_or("the .npy shape is not a tuple")?;
                let dims: Result<Vec<usize>, _> = dims
                    .split(',')
                    .map(str::trim)
                    .filter(|d| !d.is_empty())
                    .map(str::parse::<usize>)
                    .collect();
                shape = Some(dims.map_err(|_| "the .npy shape holds a non-integer".to_string())?);
            }
            _ => return Err(format!("unknown key `{}` in the .npy header", key.trim())),
        }
    }
    match descr.as_deref() {
        Some("<f4") => {}
        Some(other) => return Err(format!("expected f32 values ('<f4'), found '{other}'")),
        None => return Err("the .npy header has no descr".into()),
    }
    if fortran != Some(false) {
        return Err("the .npy array is not in C order (fortran_order must be False)".into());
    }
    shape.ok_or_else(|| "the .npy header has no shape".into())
}
