//! The attention backend (`train.attention`) and what the cuDNN one needs besides the library:
//! which calls it takes ([`AttentionBackend::runs_cudnn`]), the description of one call in the C
//! layout of `cudnn/sdpa.cpp` ([`SdpaDesc`]; `sdpa_cache.rs` caches the graphs built for them).
//! Pure logic, in every build, so the CPU tests cover it; `cuda/cudnn.rs` runs it on a GPU.
//!
//! cuDNN's fused attention reads the model's `[b, s, h, d]` activations in place: it describes
//! a tensor in the logical order `[b, h, s, d]` with element strides, which for a contiguous
//! `[b, s, h, d]` buffer are `[s·h·d, d, h·d, 1]`. The backward writes dQ, dK and dV with the
//! strides of Q, K and V into the parts of one flat buffer, as the project's kernels do. A
//! causal call with documents kept apart runs as a ragged batch of its documents
//! (`sdpa_ragged.rs`, [`SdpaDesc::documents`]).

use std::hash::{Hash, Hasher};

use candle_core::{bail, DType, Result};
use serde::{Deserialize, Serialize};

use super::attention::Dims;
use super::sdpa_ragged::Documents;

/// Which kernels run attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionBackend {
    /// The project's flash kernels (`kernels/attention*.cu`, and the CPU kernels): every dtype
    /// and head dim up to 256, deterministic.
    #[default]
    Own,
    /// cuDNN's fused attention (from `libcudnn.so.9`, loaded at start-up) for bf16 calls with
    /// a head dim that is a multiple of 8 up to [`CUDNN_MAX_HEAD_DIM`], causal calls with
    /// documents kept apart included (as a ragged batch of the documents); other calls (f32,
    /// other head dims, ring blocks with documents, and shapes cuDNN cannot build a graph for,
    /// which are logged once) run the project's kernels. Its backward runs cuDNN's
    /// deterministic algorithm, so resumed runs stay bit-exact.
    Cudnn,
    /// [`AttentionBackend::Cudnn`] with cuDNN's non-deterministic backward (dQ accumulated with
    /// atomics in one kernel, PyTorch's default), which is faster and needs less workspace but
    /// sums in a different order from run to run: a resumed run is no longer bit-exact. Not a
    /// recipe name: `train.attention: cudnn` with `train.deterministic: false`.
    #[serde(skip)]
    CudnnNondeterministic,
}

/// The largest head dim routed to cuDNN (its fused attention's forward and backward limit on
/// every supported GPU; larger ones run the project's kernels).
pub const CUDNN_MAX_HEAD_DIM: usize = 128;

impl AttentionBackend {
    /// Whether a call on storage `dtype` with head dim `d` runs on cuDNN under this backend.
    pub fn runs_cudnn(self, dtype: DType, d: usize) -> bool {
        self != AttentionBackend::Own
            && dtype == DType::BF16
            && d > 0
            && d.is_multiple_of(8)
            && d <= CUDNN_MAX_HEAD_DIM
    }

    /// The recipe's name of the backend.
    pub fn name(self) -> &'static str {
        match self {
            AttentionBackend::Own => "own",
            AttentionBackend::Cudnn => "cudnn",
            AttentionBackend::CudnnNondeterministic => "cudnn (non-deterministic backward)",
        }
    }

    /// Whether the backward sums in the same order every run (all but
    /// [`AttentionBackend::CudnnNondeterministic`]).
    pub fn deterministic(self) -> bool {
        self != AttentionBackend::CudnnNondeterministic
    }
}

impl std::str::FromStr for AttentionBackend {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "own" => Ok(AttentionBackend::Own),
            "cudnn" => Ok(AttentionBackend::Cudnn),
            _ => Err(format!("unknown attention backend `{s}` (own or cudnn)")),
        }
    }
}

impl std::fmt::Display for AttentionBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Most workspace, bytes, that the backward of documents kept apart (a ragged call) may take on
/// cuDNN's deterministic algorithm. That algorithm's workspace follows the padded batch, not the
/// packed tokens: `batch · hq · span² · 2` bytes (cuDNN 9.19 on an H200: 2 GiB for 128 document
/// slots of 512 positions and 32 heads, 8 GiB at 1024 positions, where the call's q is 16 MiB),
/// which no memory plan holds. Past this limit the backward runs cuDNN's non-deterministic
/// algorithm, whose gradients may differ in their last bits from run to run.
pub const RAGGED_DETERMINISTIC_WORKSPACE: usize = 256 << 20;

/// One fused-attention call as `cudnn/sdpa.cpp` reads it (`struct PretrainSdpa`): sizes, the
/// element strides of the `[b, h, s, d]` views of q (and out, dout, dq), k (dk) and v (dv), the
/// mask and the scale. Equal descriptions share a built graph (the scale compared by its bits).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct SdpaDesc {
    pub b: i64,
    pub hq: i64,
    pub hkv: i64,
    pub sq: i64,
    pub skv: i64,
    pub d: i64,
    pub q_stride: [i64; 4],
    pub k_stride: [i64; 4],
    pub v_stride: [i64; 4],
    pub o_stride: [i64; 4],
    /// 1: query `i` sees keys `0..=i` (`sq == skv`); 0: every key.
    pub causal: i32,
    /// 1: the backward runs cuDNN's deterministic algorithm.
    pub deterministic: i32,
    pub scale: f32,
    /// 1: a ragged batch of documents (`sdpa_ragged.rs`): `b` is the graph's batch of documents,
    /// `sq` = `skv` its span (the longest a document may be), the strides those of the packed
    /// tokens, and a run reads each document's length and element offsets from its tables.
    pub ragged: i32,
    /// Ragged: tokens of the call (all documents together); 0 otherwise.
    pub total: i64,
}

impl SdpaDesc {
    /// The call of `dm` (contiguous `q` `[b, s, hq, d]`, `k` and `v` `[b, sk, hkv, d]`) with
    /// `scale`. Errors on sizes cuDNN cannot take or a non-finite scale.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn new(dm: Dims, scale: f64, deterministic: bool) -> Result<Self> {
        let i = |what: &str, x: usize| -> Result<i64> {
            match i64::try_from(x) {
                Ok(v) if v > 0 => Ok(v),
                _ => bail!("cuDNN attention: {what} = {x} is out of range"),
            }
        };
        let (b, sq, skv) = (i("b", dm.b)?, i("s", dm.s)?, i("sk", dm.sk)?);
        let (hq, hkv, d) = (i("hq", dm.hq)?, i("hkv", dm.hkv)?, i("d", dm.d)?);
        if hq % hkv != 0 {
            bail!("cuDNN attention: query heads {hq} must be a multiple of kv heads {hkv}")
        }
        if dm.causal && sq != skv {
            bail!("cuDNN attention: a causal call needs as many keys ({skv}) as queries ({sq})")
        }
        let scale32 = scale as f32;
        if !scale32.is_finite() {
            bail!("cuDNN attention: the scale {scale} is not a finite f32")
        }
        // [b, h, s, d] views of contiguous [b, s, h, d] buffers.
        let bshd = |s: i64, h: i64| [s * h * d, d, h * d, 1];
        Ok(Self {
            b,
            hq,
            hkv,
            sq,
            skv,
            d,
            q_stride: bshd(sq, hq),
            k_stride: bshd(skv, hkv),
            v_stride: bshd(skv, hkv),
            o_stride: bshd(sq, hq),
            causal: i32::from(dm.causal),
            deterministic: i32::from(deterministic),
            scale: scale32,
            ragged: 0,
            total: 0,
        })
    }

    /// The causal call of `dm` split into `docs` (its floor's documents), as a ragged batch of
    /// [`Documents::batch`] sequences of up to [`Documents::span`] positions over the same
    /// buffers.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn documents(
        dm: Dims,
        scale: f64,
        deterministic: bool,
        docs: &Documents,
    ) -> Result<Self> {
        let whole = Self::new(dm, scale, deterministic)?;
        if !dm.causal || docs.total() != dm.b * dm.s {
            bail!(
                "cuDNN attention: documents of {} tokens for a call of {} × {} positions",
                docs.total(),
                dm.b,
                dm.s
            )
        }
        let i = |x: usize| i64::try_from(x).ok().filter(|&v| v > 0);
        let (Some(b), Some(span), Some(total)) = (i(docs.batch()), i(docs.span()), i(docs.total()))
        else {
            bail!(
                "cuDNN attention: {} documents are out of range",
                docs.count()
            )
        };
        // The batch stride (which the offsets replace) as for sequences of the span.
        let [_, h_q, s_q, one] = whole.q_stride;
        let [_, h_k, s_k, _] = whole.k_stride;
        let (q_stride, k_stride) = ([span * s_q, h_q, s_q, one], [span * s_k, h_k, s_k, one]);
        Ok(Self {
            b,
            sq: span,
            skv: span,
            q_stride,
            k_stride,
            v_stride: k_stride,
            o_stride: q_stride,
            ragged: 1,
            total,
            ..whole
        })
    }

    /// Every field as a number, the scale by its bits: what equality and hashing compare.
    fn fields(&self) -> [i64; 27] {
        let mut f = [0i64; 27];
        f[..6].copy_from_slice(&[self.b, self.hq, self.hkv, self.sq, self.skv, self.d]);
        for (i, s) in [self.q_stride, self.k_stride, self.v_stride, self.o_stride]
            .iter()
            .enumerate()
        {
            f[6 + 4 * i..10 + 4 * i].copy_from_slice(s);
        }
        f[22] = self.causal.into();
        f[23] = self.deterministic.into();
        f[24] = self.scale.to_bits().into();
        f[25] = self.ragged.into();
        f[26] = self.total;
        f
    }

    /// What to build instead of this backward when its graph needs `workspace` bytes: for a
    /// ragged call on cuDNN's deterministic algorithm past [`RAGGED_DETERMINISTIC_WORKSPACE`],
    /// the same call on the non-deterministic one; `None` keeps this description.
    pub fn lighter_backward(&self, workspace: usize) -> Option<Self> {
        (self.ragged != 0 && self.deterministic != 0 && workspace > RAGGED_DETERMINISTIC_WORKSPACE)
            .then_some(Self {
                deterministic: 0,
                ..*self
            })
    }

    /// Elements of q (and out, dq) and of k (and v, dk, dv).
    pub fn sizes(&self) -> (usize, usize) {
        let tokens = |s: i64| {
            if self.ragged != 0 {
                self.total
            } else {
                self.b * s
            }
        };
        let n = |t: i64, h: i64| (t * h * self.d) as usize;
        (n(tokens(self.sq), self.hq), n(tokens(self.skv), self.hkv))
    }
}

impl PartialEq for SdpaDesc {
    fn eq(&self, other: &Self) -> bool {
        self.fields() == other.fields()
    }
}

impl Eq for SdpaDesc {}

impl Hash for SdpaDesc {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.fields().hash(state);
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The sizes of a call (shared with the graph cache's tests).
    pub(crate) fn dims(
        b: usize,
        s: usize,
        sk: usize,
        hq: usize,
        hkv: usize,
        d: usize,
        causal: bool,
    ) -> Dims {
        Dims {
            b,
            s,
            sk,
            hq,
            hkv,
            d,
            causal,
        }
    }

    #[test]
    fn cudnn_takes_bf16_with_head_dims_it_supports() {
        let c = AttentionBackend::Cudnn;
        assert!(c.runs_cudnn(DType::BF16, 64));
        assert!(c.runs_cudnn(DType::BF16, 128));
        assert!(c.runs_cudnn(DType::BF16, 8));
        for (dtype, d) in [
            (DType::F32, 64),
            (DType::F64, 64),
            (DType::F16, 64),
            (DType::BF16, 60),
            (DType::BF16, 0),
            (DType::BF16, 136),
            (DType::BF16, 256),
        ] {
            assert!(!c.runs_cudnn(dtype, d), "{dtype:?} d {d}");
        }
        assert!(!AttentionBackend::Own.runs_cudnn(DType::BF16, 64));
    }

    #[test]
    fn backends_print_and_parse_as_the_recipe_names_them() {
        for (b, name) in [
            (AttentionBackend::Own, "own"),
            (AttentionBackend::Cudnn, "cudnn"),
        ] {
            assert_eq!(b.to_string(), name);
            assert_eq!(name.parse::<AttentionBackend>().unwrap(), b);
        }
        assert!("flash".parse::<AttentionBackend>().is_err());
        assert_eq!(AttentionBackend::default(), AttentionBackend::Own);
    }

    /// The strides address element `(b, h, s, d)` of a contiguous `[b, s, h, d]` buffer.
    #[test]
    fn strides_view_the_models_layout_in_place() {
        let dm = dims(2, 5, 7, 4, 2, 16, false);
        let p = SdpaDesc::new(dm, 0.25, true).unwrap();
        let at = |st: [i64; 4], (b, h, s, d): (i64, i64, i64, i64)| {
            b * st[0] + h * st[1] + s * st[2] + d * st[3]
        };
        for (b, s, h, d) in [(0, 0, 0, 0), (1, 4, 3, 15), (1, 2, 1, 7)] {
            let bshd = ((b * 5 + s) * 4 + h) * 16 + d;
            assert_eq!(at(p.q_stride, (b, h, s, d)), bshd);
            assert_eq!(at(p.o_stride, (b, h, s, d)), bshd);
        }
        for (b, s, h, d) in [(0, 6, 1, 15), (1, 3, 0, 2)] {
            let bshd = ((b * 7 + s) * 2 + h) * 16 + d;
            assert_eq!(at(p.k_stride, (b, h, s, d)), bshd);
            assert_eq!(at(p.v_stride, (b, h, s, d)), bshd);
        }
        assert_eq!(p.sizes(), (2 * 5 * 4 * 16, 2 * 7 * 2 * 16));
        assert_eq!((p.sq, p.skv, p.hq, p.hkv), (5, 7, 4, 2));
        assert_eq!((p.causal, p.deterministic, p.scale), (0, 1, 0.25));
    }

    /// A call with documents describes the same buffers as a ragged batch: the graph's batch is
    /// the documents', the sizes still the call's, and the key differs from the plain call's.
    #[test]
    fn documents_describe_a_ragged_batch_over_the_same_buffers() {
        let dm = dims(2, 8, 8, 4, 2, 16, true);
        let floor: Vec<u32> = [0, 0, 0, 3, 4, 4, 4, 4, 0, 0, 0, 0, 0, 5, 5, 5].into();
        let docs = Documents::from_floor(dm, Some(&floor)).unwrap();
        let plain = SdpaDesc::new(dm, 0.25, true).unwrap();
        let p = SdpaDesc::documents(dm, 0.25, true, &docs).unwrap();
        assert_eq!((p.b, p.sq, p.skv, p.ragged, p.total), (8, 8, 8, 1, 16));
        // Within a sequence the strides stay those of the packed [b, s, h, d] tokens; the batch
        // stride (replaced by the offsets) is the span's.
        let long = dims(1, 256, 256, 4, 2, 16, true);
        let floor: Vec<u32> = (0..256).map(|i| i - i % 50).collect();
        let short = Documents::from_floor(long, Some(&floor)).unwrap();
        let p64 = SdpaDesc::documents(long, 0.25, true, &short).unwrap();
        let whole = SdpaDesc::new(long, 0.25, true).unwrap();
        assert_eq!((p64.b, p64.sq, p64.skv), (8, 64, 64));
        assert_eq!(p64.sizes(), whole.sizes());
        assert_eq!(p64.q_stride[1..], whole.q_stride[1..]);
        assert_eq!(
            (p64.q_stride[0], p64.k_stride[0]),
            (64 * 4 * 16, 64 * 2 * 16)
        );
        assert_eq!(p.sizes(), plain.sizes());
        assert_eq!((p.q_stride, p.k_stride), (plain.q_stride, plain.k_stride));
        assert_eq!((p.o_stride, p.v_stride), (plain.o_stride, plain.v_stride));
        assert_ne!(p, plain);
        assert_eq!((plain.ragged, plain.total), (0, 0));
        let other = Documents::from_floor(dm, Some(&[0; 16])).unwrap();
        assert_ne!(SdpaDesc::documents(dm, 0.25, true, &other).unwrap(), p);
        let err = SdpaDesc::documents(dims(1, 12, 12, 4, 2, 16, true), 0.25, true, &docs);
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("documents of 16 tokens"));
    }

    /// Only a ragged backward on the deterministic algorithm whose workspace passes the limit is
    /// rebuilt, as the same call on the non-deterministic algorithm.
    #[test]
    fn a_ragged_backward_past_the_workspace_limit_gives_up_determinism() {
        let dm = dims(2, 8, 8, 4, 2, 16, true);
        let floor: Vec<u32> = [0, 0, 0, 3, 4, 4, 4, 4, 0, 0, 0, 0, 0, 5, 5, 5].into();
        let docs = Documents::from_floor(dm, Some(&floor)).unwrap();
        let ragged = SdpaDesc::documents(dm, 0.25, true, &docs).unwrap();
        let limit = RAGGED_DETERMINISTIC_WORKSPACE;
        assert_eq!(ragged.lighter_backward(limit), None);
        let lighter = ragged.lighter_backward(limit + 1).unwrap();
        assert_eq!(lighter.deterministic, 0);
        assert_eq!(
            SdpaDesc {
                deterministic: 1,
                ..lighter
            },
            ragged
        );
        assert_eq!(lighter.lighter_backward(usize::MAX), None);
        let plain = SdpaDesc::new(dm, 0.25, true).unwrap();
        assert_eq!(plain.lighter_backward(usize::MAX), None);
    }

    #[test]
    fn bad_calls_are_refused_by_name() {
        let err = |dm: Dims, scale: f64| SdpaDesc::new(dm, scale, true).unwrap_err().to_string();
        assert!(err(dims(1, 4, 6, 2, 2, 8, true), 1.0).contains("causal call"));
        assert!(err(dims(1, 4, 4, 3, 2, 8, false), 1.0).contains("multiple of kv heads"));
        assert!(err(dims(0, 4, 4, 2, 2, 8, false), 1.0).contains("b = 0"));
        assert!(err(dims(1, 4, 4, 2, 2, 8, false), f64::NAN).contains("scale"));
        assert!(err(dims(1, 4, 4, 2, 2, 8, false), 1e300).contains("scale"));
    }
}
