// cuDNN's fused scaled-dot-product attention (bf16, forward and backward) behind a small C ABI,
// for `crates/model/src/ops/cuda/cudnn.rs`. Built by `crates/model/build.rs` with the `cuda`
// feature against the cuDNN frontend's graph API (header-only) and cuDNN's headers; libcudnn is
// opened at run time (the frontend's dynamic loading), so the binary starts without it and only
// the attention backend `cudnn` needs it.
//
// Tensors are described in cuDNN's logical order [b, h, s, d] with element strides, so the
// model's [b, s, h, d] activations are read and written in place; the softmax statistics (the
// natural log-sum-exp of each row's scaled scores, what the context-parallel ring merges by) are
// [b, hq, sq, 1] f32, contiguous. Grouped-query attention passes fewer key/value heads than query
// heads. A ragged description (documents kept apart, `src/ops/sdpa_ragged.rs`) is a batch of
// sequences packed one after another: each run reads their lengths (the padding mask) and their
// element offsets in q/o, k/v and the statistics (written token-major, [tokens, hq]) from tables
// on the device. The shim keeps no state besides the library handle: the caller creates a cuDNN handle
// per CUDA context, builds a graph per description and direction, caches both (with the
// workspace size) and serialises the calls that use one handle (they bind it to a stream).

#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstdio>
#include <stdexcept>
#include <unordered_map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fe = cudnn_frontend;

// The frontend's dynamic loading resolves every cuDNN call through this handle.
namespace cudnn_frontend {
void *cudnn_dlhandle = nullptr;
}

extern "C" {

// One attention call: sizes, element strides of [b, h, s, d] views, the mask, the scale.
// `d_o` and `d_q` use `o_stride` and `q_stride`, `d_k` and `d_v` those of k and v. Mirrored by
// `SdpaDesc` in `src/ops/sdpa.rs`.
struct PretrainSdpa {
    int64_t b, hq, hkv, sq, skv, d;
    int64_t q_stride[4], k_stride[4], v_stride[4], o_stride[4];
    int32_t causal;         // 1: query i sees keys 0..=i (sq == skv)
    int32_t deterministic;  // backward: cuDNN's deterministic algorithm
    float scale;
    int32_t ragged;  // 1: b sequences of at most sq (= skv) positions packed in `total` tokens
    int64_t total;
};

}  // extern "C"

namespace {

enum Uid : int64_t { Q = 1, K, V, O, STATS, DO, DQ, DK, DV, SEQ_Q, SEQ_KV, OFF_Q, OFF_K, OFF_V, OFF_O, OFF_STATS };

// Guards the library handle.
std::mutex load_lock;

// What a message buffer of `len` bytes receives.
void write_message(char *msg, size_t len, const std::string &text) {
    if (msg != nullptr && len > 0) {
        std::snprintf(msg, len, "%s", text.c_str());
    }
}

void check(fe::error_t e, const char *what) {
    if (e.is_bad()) {
        throw std::runtime_error(std::string(what) + ": " + e.get_message());
    }
}

std::vector<int64_t> dims(int64_t b, int64_t h, int64_t s, int64_t d) { return {b, h, s, d}; }

std::vector<int64_t> strides(const int64_t (&s)[4]) { return {s[0], s[1], s[2], s[3]}; }

std::vector<int64_t> stats_dims(const PretrainSdpa &p) { return {p.b, p.hq, p.sq, 1}; }

// Head-major per sequence; token-major ([tokens, hq]) in a ragged batch.
std::vector<int64_t> stats_strides(const PretrainSdpa &p) {
    if (p.ragged) {
        return {p.hq * p.sq, 1, p.hq, 1};
    }
    return {p.hq * p.sq, p.sq, 1, 1};
}

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph &g, const char *name, int64_t uid,
                                                    std::vector<int64_t> d, std::vector<int64_t> s) {
    return g.tensor(fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim(d).set_stride(s));
}

std::shared_ptr<fe::graph::Tensor_attributes> stats_input(fe::graph::Graph &g, const PretrainSdpa &p) {
    return g.tensor(fe::graph::Tensor_attributes()
                        .set_name("stats")
                        .set_uid(STATS)
                        .set_dim(stats_dims(p))
                        .set_stride(stats_strides(p))
                        .set_data_type(fe::DataType_t::FLOAT));
}

// The tables of a ragged batch: lengths [b] i32 (queries and keys alike) and offsets [b + 1] i64.
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

struct Ragged {
    TensorPtr seq_q, seq_kv, off_q, off_k, off_v, off_o, off_stats;
};

Ragged ragged_tables(fe::graph::Graph &g, const PretrainSdpa &p) {
    auto table = [&](const char *name, int64_t uid, int64_t n, fe::DataType_t t) {
        return g.tensor(
            fe::graph::Tensor_attributes().set_name(name).set_uid(uid).set_dim({n, 1, 1, 1}).set_stride({1, 1, 1, 1}).set_data_type(t));
    };
    const auto i32 = fe::DataType_t::INT32;
    const auto i64 = fe::DataType_t::INT64;
    return {table("seq_q", SEQ_Q, p.b, i32),          table("seq_kv", SEQ_KV, p.b, i32),
            table("off_q", OFF_Q, p.b + 1, i64),      table("off_k", OFF_K, p.b + 1, i64),
            table("off_v", OFF_V, p.b + 1, i64),      table("off_o", OFF_O, p.b + 1, i64),
            table("off_stats", OFF_STATS, p.b + 1, i64)};
}

// A ragged description's tables, with the offsets of its inputs q, k and v set.
Ragged ragged_inputs(fe::graph::Graph &g, const PretrainSdpa &p, const TensorPtr &q, const TensorPtr &k,
                     const TensorPtr &v) {
    Ragged r = ragged_tables(g, p);
    q->set_ragged_offset(r.off_q);
    k->set_ragged_offset(r.off_k);
    v->set_ragged_offset(r.off_v);
    return r;
}

fe::graph::Graph *new_graph() {
    auto *g = new fe::graph::Graph();
    g->set_io_data_type(fe::DataType_t::BFLOAT16)
        .set_intermediate_data_type(fe::DataType_t::FLOAT)
        .set_compute_data_type(fe::DataType_t::FLOAT);
    return g;
}

void forward_graph(fe::graph::Graph &g, const PretrainSdpa &p) {
    auto q = input(g, "q", Q, dims(p.b, p.hq, p.sq, p.d), strides(p.q_stride));
    auto k = input(g, "k", K, dims(p.b, p.hkv, p.skv, p.d), strides(p.k_stride));
    auto v = input(g, "v", V, dims(p.b, p.hkv, p.skv, p.d), strides(p.v_stride));
    auto opts = fe::graph::SDPA_attributes().set_name("attention").set_generate_stats(true).set_attn_scale(p.scale);
    if (p.causal) {
        opts.set_causal_mask(true);
    }
    Ragged r;
    if (p.ragged) {
        r = ragged_inputs(g, p, q, k, v);
        opts.set_padding_mask(true).set_seq_len_q(r.seq_q).set_seq_len_kv(r.seq_kv);
    }
    auto [o, stats] = g.sdpa(q, k, v, opts);
    o->set_output(true).set_uid(O).set_dim(dims(p.b, p.hq, p.sq, p.d)).set_stride(strides(p.o_stride));
    stats->set_output(true)
        .set_uid(STATS)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dims(p))
        .set_stride(stats_strides(p));
    if (p.ragged) {
        o->set_ragged_offset(r.off_o);
        stats->set_ragged_offset(r.off_stats);
    }
}

void backward_graph(fe::graph::Graph &g, const PretrainSdpa &p) {
    auto q = input(g, "q", Q, dims(p.b, p.hq, p.sq, p.d), strides(p.q_stride));
    auto k = input(g, "k", K, dims(p.b, p.hkv, p.skv, p.d), strides(p.k_stride));
    auto v = input(g, "v", V, dims(p.b, p.hkv, p.skv, p.d), strides(p.v_stride));
    auto o = input(g, "o", O, dims(p.b, p.hq, p.sq, p.d), strides(p.o_stride));
    auto d_o = input(g, "d_o", DO, dims(p.b, p.hq, p.sq, p.d), strides(p.o_stride));
    auto stats = stats_input(g, p);
    auto opts = fe::graph::SDPA_backward_attributes()
                    .set_name("attention_backward")
                    .set_attn_scale(p.scale)
                    .set_deterministic_algorithm(p.deterministic != 0);
    if (p.causal) {
        opts.set_causal_mask(true);
    }
    Ragged r;
    if (p.ragged) {
        r = ragged_inputs(g, p, q, k, v);
        o->set_ragged_offset(r.off_o);
        d_o->set_ragged_offset(r.off_o);
        stats->set_ragged_offset(r.off_stats);
        // Sizes the per-token workspace by the tokens packed (instead of b · s), with a tile of
        // slack past the last document.
        const int64_t max_total = (p.total + 127) / 128 * 128 + 128;
        opts.set_padding_mask(true)
            .set_seq_len_q(r.seq_q)
            .set_seq_len_kv(r.seq_kv)
            .set_max_total_seq_len_q(max_total)
            .set_max_total_seq_len_kv(max_total);
    }
    auto [d_q, d_k, d_v] = g.sdpa_backward(q, k, v, o, d_o, stats, opts);
    d_q->set_output(true).set_uid(DQ).set_dim(dims(p.b, p.hq, p.sq, p.d)).set_stride(strides(p.q_stride));
    d_k->set_output(true).set_uid(DK).set_dim(dims(p.b, p.hkv, p.skv, p.d)).set_stride(strides(p.k_stride));
    d_v->set_output(true).set_uid(DV).set_dim(dims(p.b, p.hkv, p.skv, p.d)).set_stride(strides(p.v_stride));
    if (p.ragged) {
        d_q->set_ragged_offset(r.off_q);
        d_k->set_ragged_offset(r.off_k);
        d_v->set_ragged_offset(r.off_v);
    }
}

// Runs `f`, turning any failure into status 1 and a message.
template <class F>
int guarded(char *msg, size_t len, F f) {
    try {
        if (cudnn_frontend::cudnn_dlhandle == nullptr) {
            throw std::runtime_error("libcudnn is not loaded (pretrain_cudnn_load first)");
        }
        f();
        return 0;
    } catch (const std::exception &e) {
        write_message(msg, len, e.what());
    } catch (...) {
        write_message(msg, len, "unknown failure in cuDNN attention");
    }
    return 1;
}

void bind(void *handle, void *stream) {
    auto h = static_cast<cudnnHandle_t>(handle);
    const cudnnStatus_t st = fe::detail::set_stream(h, static_cast<cudaStream_t>(stream));
    if (st != CUDNN_STATUS_SUCCESS) {
        throw std::runtime_error("cudnnSetStream failed (cudnnStatus_t " + std::to_string(static_cast<int>(st)) + ")");
    }
}

// Adds a ragged batch's tables to `pack`: lengths [b] i32 and offsets [3, row] i64 (q and o,
// k and v, the statistics; b + 1 entries each, rows of b + 1 rounded up to even so that each
// starts 16-byte aligned: `RaggedTables` and `offset_row` in `src/ops/sdpa_ragged.rs`).
// Nothing for a plain call (`seq_len` null).
void add_tables(std::unordered_map<int64_t, void *> &pack, int64_t b, const int32_t *seq_len, const int64_t *offsets) {
    if (seq_len == nullptr) {
        return;
    }
    const int64_t row = (b + 2) / 2 * 2;
    auto at = [&](int64_t part) { return const_cast<int64_t *>(offsets + part * row); };
    pack[SEQ_Q] = const_cast<int32_t *>(seq_len);
    pack[SEQ_KV] = const_cast<int32_t *>(seq_len);
    pack[OFF_Q] = at(0);
    pack[OFF_O] = at(0);
    pack[OFF_K] = at(1);
    pack[OFF_V] = at(1);
    pack[OFF_STATS] = at(2);
}

void run(void *graph, void *handle, std::unordered_map<int64_t, void *> &pack, void *workspace, const char *what) {
    auto *g = static_cast<fe::graph::Graph *>(graph);
    check(g->execute(static_cast<cudnnHandle_t>(handle), pack, workspace), what);
}

}  // namespace

extern "C" {

// Opens libcudnn.so.9 (once per process) and returns its version (e.g. 91900), or 0 with the
// reason in `msg`.
int64_t pretrain_cudnn_load(char *msg, size_t len) {
    std::lock_guard<std::mutex> guard(load_lock);
    try {
        if (cudnn_frontend::cudnn_dlhandle == nullptr) {
            void *h = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
            if (h == nullptr) {
                const char *e = dlerror();
                write_message(msg, len, e ? e : "dlopen(libcudnn.so.9) failed");
                return 0;
            }
            cudnn_frontend::cudnn_dlhandle = h;
        }
        return static_cast<int64_t>(fe::detail::get_backend_version());
    } catch (const std::exception &e) {
        write_message(msg, len, e.what());
    }
    return 0;
}

// A cuDNN handle in the calling thread's current CUDA context, in `handle`.
int pretrain_cudnn_handle(void **handle, char *msg, size_t len) {
    return guarded(msg, len, [&] {
        cudnnHandle_t h = nullptr;
        const cudnnStatus_t st = fe::detail::create_handle(&h);
        if (st != CUDNN_STATUS_SUCCESS) {
            throw std::runtime_error("cudnnCreate failed (cudnnStatus_t " + std::to_string(static_cast<int>(st)) +
                                     ")");
        }
        *handle = h;
    });
}

// Builds the graph of `p` (the backward when `backward` is 1) for `handle`: the graph in `graph`
// (kept for the process's life) and the workspace bytes each of its runs needs in `workspace`.
int pretrain_sdpa_build(const PretrainSdpa *p, int32_t backward, void *handle, void **graph, int64_t *workspace,
                        char *msg, size_t len) {
    return guarded(msg, len, [&] {
        std::unique_ptr<fe::graph::Graph> g(new_graph());
        if (backward) {
            backward_graph(*g, *p);
        } else {
            forward_graph(*g, *p);
        }
        check(g->build(static_cast<cudnnHandle_t>(handle), {fe::HeurMode_t::A}),
              backward ? "building the attention backward graph" : "building the attention graph");
        check(g->get_workspace_size(*workspace), "the attention graph's workspace size");
        *graph = g.release();
    });
}

// A forward graph's run on `stream`: `o` (bf16) and `stats` ([b, hq, sq] f32; ragged: [total,
// hq]). A ragged graph of `b` sequences reads `seq_len` and `offsets`, a plain one none (null).
int pretrain_sdpa_fwd(void *graph, void *handle, void *stream, const void *q, const void *k, const void *v, void *o,
                      float *stats, int64_t b, const int32_t *seq_len, const int64_t *offsets, void *workspace,
                      char *msg, size_t len) {
    return guarded(msg, len, [&] {
        bind(handle, stream);
        std::unordered_map<int64_t, void *> pack = {{Q, const_cast<void *>(q)},
                                                    {K, const_cast<void *>(k)},
                                                    {V, const_cast<void *>(v)},
                                                    {O, o},
                                                    {STATS, stats}};
        add_tables(pack, b, seq_len, offsets);
        run(graph, handle, pack, workspace, "the attention forward");
    });
}

// A backward graph's run on `stream` from the forward's `o` and `stats` and the output's
// gradient `d_o`: `d_q`, `d_k`, `d_v` (bf16); the tables as for the forward.
int pretrain_sdpa_bwd(void *graph, void *handle, void *stream, const void *q, const void *k, const void *v,
                      const void *o, const void *d_o, const float *stats, void *d_q, void *d_k, void *d_v,
                      int64_t b, const int32_t *seq_len, const int64_t *offsets, void *workspace, char *msg,
                      size_t len) {
    return guarded(msg, len, [&] {
        bind(handle, stream);
        std::unordered_map<int64_t, void *> pack = {{Q, const_cast<void *>(q)},
                                                    {K, const_cast<void *>(k)},
                                                    {V, const_cast<void *>(v)},
                                                    {O, const_cast<void *>(o)},
                                                    {DO, const_cast<void *>(d_o)},
                                                    {STATS, const_cast<float *>(stats)},
                                                    {DQ, d_q},
                                                    {DK, d_k},
                                                    {DV, d_v}};
        add_tables(pack, b, seq_len, offsets);
        run(graph, handle, pack, workspace, "the attention backward");
    });
}

// Frees a graph of `pretrain_sdpa_build` that will not run (one replaced by a lighter graph).
void pretrain_sdpa_free(void *graph) { delete static_cast<fe::graph::Graph *>(graph); }

}  // extern "C"
