//! Streaming safetensors writer: the header is computed from the tensors' names, dtypes and shapes
//! up front, then each tensor's bytes are produced and written one at a time, so writing a model
//! never needs memory for more than one tensor. (The `safetensors` crate serialises only from
//! tensors already in memory; files written here are read back with it.)

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::CkptError;
use crate::Result;

/// A tensor to be written: name, safetensors dtype string (`"F32"`, `"BF16"`), shape.
#[derive(Debug, Clone)]
pub struct TensorSpec {
    /// Tensor name.
    pub name: String,
    /// safetensors dtype code.
    pub dtype: &'static str,
    /// Shape.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// Bytes of the tensor's data.
    pub fn nbytes(&self) -> usize {
        let width = match self.dtype {
            "F64" | "I64" | "U64" => 8,
            "F32" | "I32" | "U32" => 4,
            "BF16" | "F16" | "I16" | "U16" => 2,
            _ => 1,
        };
        width * self.shape.iter().product::<usize>()
    }
}

/// Writes `tensors` to `path` in the given order; `data(i)` returns tensor `i`'s little-endian
/// bytes, which must have `tensors[i].nbytes()` bytes.
pub fn write_streaming(
    path: &Path,
    tensors: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
    mut data: impl FnMut(usize) -> Result<Vec<u8>>,
) -> Result<u64> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert(
            "__metadata__".into(),
            serde_json::to_value(metadata).expect("strings serialise"),
        );
    }
    let mut offset = 0usize;
    for t in tensors {
        let n = t.nbytes();
        header.insert(
            t.name.clone(),
            serde_json::json!({ "dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + n] }),
        );
        offset += n;
    }
    let mut json = serde_json::to_vec(&header).expect("headers serialise");
    while !json.len().is_multiple_of(8) {
        json.push(b' '); // the format allows trailing spaces; 8-byte alignment of the data
    }
    let file = File::create(path).map_err(CkptError::io(path))?;
    let mut out = BufWriter::new(file);
    out.write_all(&(json.len() as u64).to_le_bytes())
        .map_err(CkptError::io(path))?;
    out.write_all(&json).map_err(CkptError::io(path))?;
    for (i, t) in tensors.iter().enumerate() {
        let bytes = data(i)?;
        if bytes.len() != t.nbytes() {
            return Err(CkptError::Format {
                path: path.to_path_buf(),
                message: format!(
                    "tensor {} has {} bytes, its shape needs {}",
                    t.name,
                    bytes.len(),
                    t.nbytes()
                ),
            });
        }
        out.write_all(&bytes).map_err(CkptError::io(path))?;
    }
    let file = out.into_inner().map_err(|e| CkptError::Io {
        path: path.to_path_buf(),
        error: e.into_error(),
    })?;
    file.sync_all().map_err(CkptError::io(path))?;
    Ok(8 + json.len() as u64 + offset as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_read_back_with_the_safetensors_crate() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        let specs = vec![
            TensorSpec {
                name: "b".into(),
                dtype: "F32",
                shape: vec![2, 3],
            },
            TensorSpec {
                name: "a".into(),
                dtype: "BF16",
                shape: vec![3],
            },
        ];
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        write_streaming(&path, &specs, &meta, |i| {
            Ok(if i == 0 {
                (0..6).flat_map(|x| (x as f32).to_le_bytes()).collect()
            } else {
                vec![1, 2, 3, 4, 5, 6]
            })
        })
        .unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let b = st.tensor("b").unwrap();
        assert_eq!(b.shape(), &[2, 3]);
        assert_eq!(&b.data()[4..8], &1f32.to_le_bytes());
        assert_eq!(st.tensor("a").unwrap().data(), &[1, 2, 3, 4, 5, 6]);
        let (_, m) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(m.metadata().as_ref().unwrap()["format"], "pt");
        let bad = write_streaming(&path, &specs, &meta, |_| Ok(vec![0; 3]));
        let e = bad.unwrap_err().to_string();
        assert!(
            e.contains("tensor b has 3 bytes, its shape needs 24"),
            "{e}"
        );
    }
}
