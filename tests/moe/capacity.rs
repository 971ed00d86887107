//! Expert capacity: which pairs it drops, and padded routing on the device against routing on
//! the host.

use candle_core::Tensor;
use model::moe;
use model::{CapacityPolicy, MoeConfig};

use super::{config, diff, hand_written, inputs, layer};

/// An expert capacity drops each expert's least probable pairs beyond it (they contribute
/// nothing, as in a dense reference without them); a capacity above every expert's load changes
/// nothing at all.
#[test]
fn capacity_drops_the_least_probable_pairs() {
    let t: Vec<Tensor> = inputs().iter().map(|v| v.as_tensor().clone()).collect();
    let run = |capacity: Option<f64>| {
        let cfg = MoeConfig {
            capacity_factor: capacity,
            ..config(true)
        };
        let (y, stats, _) = layer(&t, &cfg, 0, None);
        (y, stats)
    };
    let (free, roomy, tight) = (run(None), run(Some(4.0)), run(Some(0.5)));
    assert_eq!(diff(&roomy.0, &free.0), 0.0);
    assert_eq!(
        (free.1.dropped().unwrap(), roomy.1.dropped().unwrap()),
        (0, 0)
    );
    // Capacity ceil(0.5 · 24 / 4) = 3 per expert.
    let loads = free.1.tokens_per_expert().unwrap();
    let want: u64 = loads.iter().map(|&c| c.saturating_sub(3)).sum();
    assert!(want > 0, "{loads:?}: the case drops nothing");
    assert_eq!(tight.1.dropped().unwrap(), want);
    assert_eq!(
        tight.1.tokens_per_expert().unwrap(),
        loads,
        "loads are counted before the capacity"
    );
    // Tokens whose pairs were all kept have the dropless output; some token changed.
    let changed = (&tight.0 - &free.0)
        .unwrap()
        .abs()
        .unwrap()
        .sum(1)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    assert!(changed.iter().any(|&c| c > 0.0));
    assert!(changed.iter().filter(|&&c| c == 0.0).count() > 0);
}

/// Padded routing on the device keeps what `position` keeps on the host: the same loads and
/// drops, and the same output and gradients (the padding rows are zero and add nothing) within
/// f64's rounding (the CPU's GEMMs over more rows may block their sums otherwise).
#[test]
fn padded_routing_on_the_device_equals_position_on_the_host() {
    let t: Vec<Tensor> = inputs().iter().map(|v| v.as_tensor().clone()).collect();
    let cfg = |policy| MoeConfig {
        capacity_factor: Some(0.5),
        capacity_policy: policy,
        ..config(true)
    };
    let (host, device) = (cfg(CapacityPolicy::Position), cfg(CapacityPolicy::Padded));
    let bias = [0.05f32, -0.02, 0.0, 0.01];
    for bias in [None, Some(&bias[..])] {
        let (y_host, s_host, _) = layer(&t, &host, 0, bias);
        let (y_device, s_device, _) = layer(&t, &device, 0, bias);
        assert!(diff(&y_host, &y_device) < 1e-14, "bias {bias:?}");
        let counts = |s: &moe::LayerStats| {
            (
                s.tokens_per_expert().unwrap(),
                s.dropped().unwrap(),
                s.load_balancing().unwrap(),
            )
        };
        assert_eq!(counts(&s_host), counts(&s_device), "bias {bias:?}");
        assert!(s_device.dropped().unwrap() > 0, "the case drops nothing");
        let (g_host, g_device) = (
            hand_written(&t, &host, bias),
            hand_written(&t, &device, bias),
        );
        for (i, (a, b)) in g_host.iter().zip(&g_device).enumerate() {
            match (a, b) {
                (Some(a), Some(b)) => assert!(diff(a, b) < 1e-14, "bias {bias:?} input {i}"),
                // An expert that kept no pair: no gradient on the host, zeros when padded.
                (None, Some(b)) => {
                    let sum = b.abs().unwrap().sum_all().unwrap();
                    assert_eq!(sum.to_scalar::<f64>().unwrap(), 0.0, "input {i}");
                }
                (a, b) => panic!("input {i}: {:?} against {:?}", a.is_some(), b.is_some()),
            }
        }
    }
}
