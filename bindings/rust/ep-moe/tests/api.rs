//! The safe bindings against the library: an expert map query, a 2-rank
//! in-process forward equal (bit for bit) to the same forward run through
//! the raw C API, and bad arguments surfacing as `Err` with the message.
use ep_moe::sys;
use ep_moe::*;
use std::thread;

const H: usize = 16;
const I: usize = 8;
const E: usize = 6;
const K: usize = 2;
const T: usize = 5;

fn value(a: usize, b: usize, m: usize) -> f32 {
    0.02 * (((a * 7 + b * 3) % m) as f32 - (m / 2) as f32)
}

fn weights(e: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let g = (0..I * H).map(|i| value(e, i, 11)).collect();
    let u = (0..I * H).map(|i| value(e + 1, i, 13)).collect();
    let d = (0..H * I).map(|i| value(e + 2, i, 9)).collect();
    (g, u, d)
}

fn inputs() -> (Vec<f32>, Vec<f32>) {
    let x = (0..T * H).map(|i| value(i, 1, 17)).collect();
    let logits = (0..T * E).map(|i| 10.0 * value(i, 5, 23)).collect();
    (x, logits)
}

fn layer_config() -> LayerConfig {
    let mut c = LayerConfig::default();
    c.hidden_size = H as i32;
    c.intermediate_size = I as i32;
    c.num_experts = E as i32;
    c.top_k = K as i32;
    c.max_tokens = T as i32;
    c.num_threads = 1;
    c
}

#[test]
fn expert_map_query() {
    let map = ExpertMap::new(&ExpertMapConfig::new(4, 1, 10)).unwrap();
    assert_eq!(map.describe().unwrap(), "0->3, 1->4, 2->5");
    assert_eq!(map.global_to_local(4).unwrap(), Some(1));
    assert_eq!(map.global_to_local(9).unwrap(), None);
    assert_eq!(map.attr(sys::EP_MOE_MAP_ATTR_NUM_LOCAL_ROUTED).unwrap(), 3);
    assert_eq!(map.table(sys::EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL).unwrap(), vec![3, 4, 5]);
    let custom = ExpertMap::new(&ExpertMapConfig::new(2, 1, 3).custom(vec![0, 1, 2, 0], vec![])).unwrap();
    assert_eq!(custom.table(sys::EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL).unwrap(), vec![2, 0]);
    let (major, minor, patch) = version();
    assert_eq!((major, minor, patch), (sys::EP_MOE_VERSION_MAJOR, sys::EP_MOE_VERSION_MINOR, sys::EP_MOE_VERSION_PATCH));
    assert!(has_feature(sys::EP_MOE_FEATURE_CPU as u32));
}

/// Rank `r` of `ep` through the safe API.
fn rank_safe(ep: i32, r: i32, mut comm: Comm) -> Vec<f32> {
    let map = ExpertMap::new(&ExpertMapConfig::new(ep, r, E as i32)).unwrap();
    let mut layer = Layer::new(&layer_config(), &map, LayerComms::Ep(&mut comm)).unwrap();
    for e in 0..E {
        let (g, u, d) = weights(e);
        layer.set_weight(sys::EP_MOE_WEIGHT_EXPERT_GATE, e as i32, &g, I as i64, H as i64).unwrap();
        layer.set_weight(sys::EP_MOE_WEIGHT_EXPERT_UP, e as i32, &u, I as i64, H as i64).unwrap();
        layer.set_weight(sys::EP_MOE_WEIGHT_EXPERT_DOWN, e as i32, &d, H as i64, I as i64).unwrap();
    }
    let (x, logits) = inputs();
    let mut out = vec![0f32; T * H];
    layer.forward(&x, Routing::Logits(&logits), &mut out, None).unwrap();
    out
}

/// Rank `r` of `ep` through the raw C API only.
fn rank_raw(ep: i32, r: i32, comm: usize) -> Vec<f32> {
    let comm = comm as *mut sys::ep_moe_comm_t;
    unsafe {
        let mut mc: sys::ep_moe_expert_map_config_t = std::mem::zeroed();
        sys::ep_moe_expert_map_config_init(&mut mc);
        mc.ep_size = ep;
        mc.ep_rank = r;
        mc.global_num_experts = E as i32;
        let mut map = std::ptr::null_mut();
        assert_eq!(sys::ep_moe_expert_map_create(&mut map, &mc), sys::EP_MOE_OK);
        let lc = layer_config();
        let mut layer = std::ptr::null_mut();
        assert_eq!(sys::ep_moe_layer_create(&mut layer, &*lc, map, comm, std::ptr::null_mut()), sys::EP_MOE_OK);
        sys::ep_moe_expert_map_destroy(map);
        for e in 0..E {
            let (g, u, d) = weights(e);
            for (which, v, rows, cols) in [
                (sys::EP_MOE_WEIGHT_EXPERT_GATE, &g, I, H),
                (sys::EP_MOE_WEIGHT_EXPERT_UP, &u, I, H),
                (sys::EP_MOE_WEIGHT_EXPERT_DOWN, &d, H, I),
            ] {
                let s = sys::ep_moe_layer_set_weight(
                    std::ptr::null_mut(),
                    layer,
                    which,
                    e as i32,
                    v.as_ptr() as *const _,
                    sys::EP_MOE_DTYPE_F32,
                    rows as i64,
                    cols as i64,
                );
                assert_eq!(s, sys::EP_MOE_OK);
            }
        }
        let (x, logits) = inputs();
        let mut out = vec![0f32; T * H];
        let mut a: sys::ep_moe_forward_args_t = std::mem::zeroed();
        sys::ep_moe_forward_args_init(&mut a);
        a.num_tokens = T as i64;
        a.hidden = x.as_ptr() as *const _;
        a.router_logits = logits.as_ptr() as *const _;
        a.out = out.as_mut_ptr() as *mut _;
        assert_eq!(sys::ep_moe_layer_forward(layer, &a), sys::EP_MOE_OK);
        sys::ep_moe_layer_destroy(layer);
        out
    }
}

#[test]
fn two_rank_forward_matches_the_c_api() {
    let comms = Comm::local_group(2, 30000).unwrap();
    assert_eq!(comms[1].rank(), 1);
    assert_eq!(comms[0].size(), 2);
    let safe: Vec<Vec<f32>> = comms
        .into_iter()
        .enumerate()
        .map(|(r, c)| thread::spawn(move || rank_safe(2, r as i32, c)))
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();

    let mut raw = vec![std::ptr::null_mut(); 2];
    unsafe { assert_eq!(sys::ep_moe_comm_create_local(raw.as_mut_ptr(), 2, std::ptr::null()), sys::EP_MOE_OK) };
    let through_c: Vec<Vec<f32>> = raw
        .iter()
        .enumerate()
        .map(|(r, &c)| {
            let c = c as usize;
            thread::spawn(move || rank_raw(2, r as i32, c))
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    for c in raw {
        unsafe { sys::ep_moe_comm_destroy(c) };
    }
    assert_eq!(safe[0], through_c[0]);
    assert_eq!(safe[1], through_c[1]);
    assert_eq!(safe[0], safe[1]);
    assert!(safe[0].iter().any(|v| *v != 0.0));
}

#[test]
fn bad_arguments_are_errors_with_the_message() {
    let e = ExpertMap::new(&ExpertMapConfig::new(4, 4, 8)).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("ep_rank"), "{}", e.message);

    let map = ExpertMap::new(&ExpertMapConfig::new(1, 0, E as i32)).unwrap();
    assert_eq!(map.global_to_local(99).err().unwrap().status, Status::InvalidArgument);
    let mut layer = Layer::new(&layer_config(), &map, LayerComms::None).unwrap();
    let w = vec![0f32; I * H];
    let e = layer.set_weight(sys::EP_MOE_WEIGHT_EXPERT_DOWN, 0, &w, I as i64, H as i64).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("must be [16, 8], got [8, 16]"), "{}", e.message);
    let e = layer.set_weight(sys::EP_MOE_WEIGHT_EXPERT_DOWN, 0, &w[..5], H as i64, I as i64).err().unwrap();
    assert!(e.message.contains("rows * cols"), "{}", e.message);
    // Forward before the weights are set.
    let (x, logits) = inputs();
    let mut out = vec![0f32; T * H];
    let e = layer.forward(&x, Routing::Logits(&logits), &mut out, None).err().unwrap();
    assert_eq!(e.status, Status::State);
    assert!(e.message.contains("has no gate_proj"), "{}", e.message);
    let e = Checkpoint::open("/nonexistent/model.safetensors").err().unwrap();
    assert_eq!(e.status, Status::Io);
    assert_eq!(format!("{}", e).split(':').next().unwrap(), "Io");
}

#[test]
fn abort_from_another_thread_ends_a_blocked_collective() {
    let mut comms = Comm::local_group(2, 30000).unwrap();
    let mut c0 = comms.remove(0);
    let aborter = c0.abort_handle();
    let t = thread::spawn(move || {
        thread::sleep(std::time::Duration::from_millis(100));
        aborter.abort();
    });
    let e = c0.barrier().err().unwrap(); // rank 1 never joins
    t.join().unwrap();
    assert_eq!(e.status, Status::Aborted);
    assert_eq!(c0.async_error().map(|(s, _)| s), Some(Status::Aborted));
    let mut v = [Bf16::from_f32(1.5)];
    assert_eq!(c0.all_reduce(&mut v).err().unwrap().status, Status::Aborted);
    assert_eq!(Bf16::from_f32(1.5).to_f32(), 1.5);
}

/// Load statistics, a rebalanced placement applied live, then elastic 2 -> 1.
#[test]
fn load_rebalance_replace() {
    let comms = Comm::local_group(2, 30000).unwrap();
    let outs: Vec<(Vec<f32>, Vec<f32>, Vec<i64>)> = comms
        .into_iter()
        .enumerate()
        .map(|(r, mut comm)| {
            thread::spawn(move || {
                let r = r as i32;
                let map = ExpertMap::new(&ExpertMapConfig::new(2, r, E as i32)).unwrap();
                let mut layer = Layer::new(&layer_config(), &map, LayerComms::Ep(&mut comm)).unwrap();
                for e in 0..E {
                    let (g, u, d) = weights(e);
                    layer.set_weight(sys::EP_MOE_WEIGHT_EXPERT_GATE, e as i32, &g, I as i64, H as i64).unwrap();
                    layer.set_weight(sys::EP_MOE_WEIGHT_EXPERT_UP, e as i32, &u, I as i64, H as i64).unwrap();
                    layer.set_weight(sys::EP_MOE_WEIGHT_EXPERT_DOWN, e as i32, &d, H as i64, I as i64).unwrap();
                }
                let (x, logits) = inputs();
                let mut before = vec![0f32; T * H];
                layer.forward(&x, Routing::Logits(&logits), &mut before, None).unwrap();
                let load = layer.expert_load(true, true).unwrap();
                let (slots, imbalance) =
                    rebalance(&load.iter().map(|&v| v as f64).collect::<Vec<_>>(), 8, 2, 0, 0, &[]).unwrap();
                assert!(imbalance >= 1.0);
                let next = ExpertMap::new(&ExpertMapConfig::new(2, r, E as i32).custom(slots, vec![])).unwrap();
                layer.replace(&next, None, 0).unwrap();
                let mut after = vec![0f32; T * H];
                layer.forward(&x, Routing::Logits(&logits), &mut after, None).unwrap();
                assert_eq!(layer.attr(sys::EP_MOE_LAYER_ATTR_REPLACE_BYTES_READ).unwrap(), 0);
                (before, after, load)
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect();
    // Every routed pair counted once: T * K in all.
    assert_eq!(outs[0].2.iter().sum::<i64>(), (T * K) as i64);
    assert_eq!(outs[0].2, outs[1].2);
    for (before, after, _) in &outs {
        for (a, b) in before.iter().zip(after) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{} vs {}", a, b);
        }
    }
    let e = rebalance(&[1.0, 2.0], 3, 2, 0, 0, &[]).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("multiple"), "{}", e.message);
}

/// Elastic: a layer moves to another group (and a map that does not fit it
/// leaves the layer as it was).
#[test]
fn replace_with_a_new_group() {
    let mut solo = Comm::local_group(1, 30000).unwrap().pop().unwrap();
    let mut layer_comm = Comm::local_group(1, 30000).unwrap().pop().unwrap();
    let map = ExpertMap::new(&ExpertMapConfig::new(1, 0, E as i32)).unwrap();
    let mut layer = Layer::new(&layer_config(), &map, LayerComms::Ep(&mut layer_comm)).unwrap();
    for e in 0..E {
        let (g, u, d) = weights(e);
        layer.set_weight(sys::EP_MOE_WEIGHT_EXPERT_GATE, e as i32, &g, I as i64, H as i64).unwrap();
        layer.set_weight(sys::EP_MOE_WEIGHT_EXPERT_UP, e as i32, &u, I as i64, H as i64).unwrap();
        layer.set_weight(sys::EP_MOE_WEIGHT_EXPERT_DOWN, e as i32, &d, H as i64, I as i64).unwrap();
    }
    // A map that does not fit the group: the layer comes back unchanged.
    let wrong = ExpertMap::new(&ExpertMapConfig::new(2, 1, E as i32)).unwrap();
    let (mut layer, e) = layer.replace_with_comm(&wrong, &mut solo, None, 0).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    let (x, logits) = inputs();
    let mut before = vec![0f32; T * H];
    layer.forward(&x, Routing::Logits(&logits), &mut before, None).unwrap();
    let mut moved = layer.replace_with_comm(&map, &mut solo, None, 0).map_err(|(_, e)| e).unwrap();
    let mut after = vec![0f32; T * H];
    moved.forward(&x, Routing::Logits(&logits), &mut after, None).unwrap();
    assert_eq!(before, after);
}

#[test]
fn forward_slices_must_match_the_layer_dtypes() {
    let map = ExpertMap::new(&ExpertMapConfig::new(1, 0, E as i32)).unwrap();
    let mut cfg = layer_config();
    cfg.act_dtype = sys::EP_MOE_DTYPE_BF16 as i32;
    let mut layer = Layer::new(&cfg, &map, LayerComms::None).unwrap();
    let mut f32_layer = Layer::new(&layer_config(), &map, LayerComms::None).unwrap();
    for e in 0..E {
        let (g, u, d) = weights(e);
        for l in [&mut layer, &mut f32_layer] {
            l.set_weight(sys::EP_MOE_WEIGHT_EXPERT_GATE, e as i32, &g, I as i64, H as i64).unwrap();
            l.set_weight(sys::EP_MOE_WEIGHT_EXPERT_UP, e as i32, &u, I as i64, H as i64).unwrap();
            l.set_weight(sys::EP_MOE_WEIGHT_EXPERT_DOWN, e as i32, &d, H as i64, I as i64).unwrap();
        }
    }
    let (x, logits) = inputs();
    // f32 slices on a bf16 layer: an error, not a wrong answer.
    let mut out = vec![0f32; T * H];
    let e = layer.forward(&x, Routing::Logits(&logits), &mut out, None).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("act_dtype is Some(Bf16)"), "{}", e.message);
    let e = layer.forward(&x, Routing::Logits16(&[0u16; T * E]), &mut out, None).err().unwrap();
    assert!(e.message.contains("act_dtype"), "{}", e.message);
    // Bf16 slices: the f32 layer's answer to bf16 precision.
    let xb: Vec<Bf16> = x.iter().map(|v| Bf16::from_f32(*v)).collect();
    let mut ob = vec![Bf16::default(); T * H];
    layer.forward(&xb, Routing::Logits(&logits), &mut ob, None).unwrap();
    let xr: Vec<f32> = xb.iter().map(|v| v.to_f32()).collect();
    f32_layer.forward(&xr, Routing::Logits(&logits), &mut out, None).unwrap();
    let peak = out.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (b, f) in ob.iter().zip(&out) {
        assert!((b.to_f32() - f).abs() <= 1e-2 * peak, "{} vs {}", b.to_f32(), f);
    }
    // And 16-bit logits on an f32-router layer are refused.
    let e = f32_layer.forward(&x, Routing::Logits16(&[0u16; T * E]), &mut out, None).err().unwrap();
    assert!(e.message.contains("router_dtype is f32"), "{}", e.message);
}

#[test]
fn f16_conversions_round_to_nearest_even() {
    for (v, bits) in [
        (1.0f32, 0x3c00u16),
        (-2.0, 0xc000),
        (65504.0, 0x7bff),
        (65520.0, 0x7c00),      // rounds up to infinity
        (6.103_515_6e-5, 0x0400), // smallest normal
        (5.960_464_5e-8, 0x0001), // smallest subnormal
        (2.980_232_2e-8, 0x0000), // half of it: ties to even (0)
        (1.000_488_3, 0x3c00),  // 1 + 2^-11: a tie, to even
        (1.001_464_8, 0x3c02),  // 1 + 3 * 2^-11: a tie, to even (up)
        (0.0, 0x0000),
    ] {
        assert_eq!(F16::from_f32(v).0, bits, "{}", v);
    }
    for bits in [0x3c00u16, 0xc000, 0x7bff, 0x0400, 0x0001, 0x03ff, 0x8001, 0x7c00] {
        assert_eq!(F16::from_f32(F16(bits).to_f32()).0, bits, "{:#x}", bits);
    }
    assert!(F16::from_f32(f32::NAN).to_f32().is_nan());
}

#[test]
fn block_format_weights_are_kept_or_refused_with_the_message() {
    assert_eq!(BlockFormat::Q4K.block(), (256, 144));
    assert_eq!(BlockFormat::Q8_0.block(), (32, 34));
    assert_eq!(BlockFormat::Iq2Xxs.block(), (256, 66));
    assert_eq!(BlockFormat::Q3K.block(), (256, 110));
    assert_eq!(BlockFormat::Q4_1.block(), (32, 20));
    assert_eq!(BlockFormat::Fp8E4m3.block(), (128, 132));
    let map = ExpertMap::new(&ExpertMapConfig::new(1, 0, 2)).unwrap();
    let mut c = LayerConfig::default();
    c.hidden_size = 64;
    c.intermediate_size = 32;
    c.num_experts = 2;
    c.top_k = 1;
    c.max_tokens = 2;
    c.num_threads = 1;
    let mut layer = Layer::new(&c, &map, LayerComms::None).unwrap();
    // Q8_0 gate [32, 64]: 32 rows of 2 blocks of 34 bytes, scale 1/64 (f16 0x2400).
    let mut gate = vec![0u8; 32 * 2 * 34];
    for b in 0..64 {
        gate[b * 34] = 0x00;
        gate[b * 34 + 1] = 0x24;
        for i in 0..32 {
            gate[b * 34 + 2 + i] = (i as u8).wrapping_mul(7);
        }
    }
    assert!(layer.set_weight_blocks(sys::EP_MOE_WEIGHT_EXPERT_GATE, 0, &gate, BlockFormat::Q8_0, 32, 64).unwrap());
    let e = layer.set_weight_blocks(sys::EP_MOE_WEIGHT_EXPERT_GATE, 0, &gate[1..], BlockFormat::Q8_0, 32, 64);
    assert!(e.err().unwrap().message.contains("blocks has"));
    // Another format for the same part of another expert: refused by the library, by name.
    let q4 = vec![0u8; 32 * 2 * 18];
    let e = layer.set_weight_blocks(sys::EP_MOE_WEIGHT_EXPERT_GATE, 1, &q4, BlockFormat::Q4_0, 32, 64).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("q8_0"), "{}", e.message);
}

#[test]
fn safe_code_cannot_make_the_library_read_outside_its_slices() {
    // A DP slice shorter than the layer's DP size (here 1): an error, where C
    // read dp_token_counts[0] past an empty slice.
    let map = ExpertMap::new(&ExpertMapConfig::new(1, 0, E as i32)).unwrap();
    let mut layer = Layer::new(&layer_config(), &map, LayerComms::None).unwrap();
    let (x, logits) = inputs();
    let mut out = vec![0f32; T * H];
    let dp = Dp { token_counts: &[], is_decode: None, is_graph: false, is_prefill: false };
    let e = layer.forward(&x, Routing::Logits(&logits), &mut out, Some(dp)).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("token_counts has 0 entries, not the layer's DP size 1"), "{}", e.message);
    let counts = [T as i32];
    let dp = Dp { token_counts: &counts, is_decode: Some(&[]), is_graph: false, is_prefill: false };
    let e = layer.forward(&x, Routing::Logits(&logits), &mut out, Some(dp)).err().unwrap();
    assert!(e.message.contains("is_decode has 0 entries"), "{}", e.message);
    // A per_rank table shorter than ep_size: an error, not a read past it.
    let e = ExpertMap::new(&ExpertMapConfig::new(4, 0, 8).custom((0..8).collect(), vec![2, 2])).err().unwrap();
    assert_eq!(e.status, Status::InvalidArgument);
    assert!(e.message.contains("per_rank has 2 entries, not ep_size = 4"), "{}", e.message);
    // Raw pointers written through DerefMut never reach C: the slot fields
    // come from the owned vectors.
    let mut cfg = ExpertMapConfig::new(2, 0, 4);
    cfg.custom_slots = 0x10 as *const i32;
    cfg.num_custom_slots = 1000;
    cfg.custom_slots_per_rank = 0x20 as *const i32;
    let m = ExpertMap::new(&cfg).unwrap();  // linear placement: no slots read
    assert_eq!(m.table(sys::EP_MOE_MAP_TABLE_LOCAL_TO_GLOBAL).unwrap(), vec![0, 1]);
    cfg.placement = sys::EP_MOE_PLACEMENT_CUSTOM;
    let e = ExpertMap::new(&cfg).err().unwrap();  // custom without slots: refused by C, nothing read
    assert_eq!(e.status, Status::InvalidArgument);
}
