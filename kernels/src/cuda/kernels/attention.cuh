// What every attention kernel shares: the problem (sizes, scale, mask) as one struct passed by value, the mask
// by global positions exactly as the CPU defines it (crate::attention::mask), and the classification of a
// (query tile, key tile) pair from per-tile summaries the host computes for each call.
//
// Layout (crate::attention): Q, O, dQ, dO [B, Hq, Sq, D]; K, V, dK, dV [B, Hkv, Sk, D]; LSE [B, Hq, Sq] f32. Query
// head h reads key/value head h / (Hq / Hkv).

// Position and document range of one tile of rows (crate::attention::mask::RangeSummary).
struct TileSummary {
    i64 pos_min;
    i64 pos_max;
    u32 doc_min;
    u32 doc_max;
};

// One attention problem; mirrored field for field by `AttnProblem` in ops/attention.rs (112 bytes).
struct AttnProblem {
    u32 batch, q_heads, kv_heads, q_len, kv_len, head_dim;
    float scale;
    u32 causal;
    u64 window;  // 0: no window
    const i64* q_pos;  // null: q_off + row
    const i64* k_pos;  // null: k_off + row
    i64 q_off;
    i64 k_off;
    const u32* q_doc;  // null: no documents (then k_doc is null too)
    const u32* k_doc;
    const TileSummary* q_tiles;  // one per q_tile query rows
    const TileSummary* k_tiles;  // one per k_tile key rows
    u32 q_tile, k_tile;
};

#define TILE_HIDDEN 0
#define TILE_VISIBLE 1
#define TILE_PARTIAL 2

__device__ __forceinline__ i64 q_position(const AttnProblem& p, u32 i) { return p.q_pos ? p.q_pos[i] : p.q_off + (i64)i; }
__device__ __forceinline__ i64 k_position(const AttnProblem& p, u32 j) { return p.k_pos ? p.k_pos[j] : p.k_off + (i64)j; }

// a − b ≥ w, exactly (a − b may not fit in i64; w ≥ 1).
__device__ __forceinline__ bool diff_ge(i64 a, i64 b, u64 w) { return a >= b && (u64)a - (u64)b >= w; }

// Whether query row i sees key row j: causal (t ≤ p), window (|p − t| < w), same document.
__device__ __forceinline__ bool visible(const AttnProblem& p, u32 i, u32 j) {
    i64 qp = q_position(p, i), kp = k_position(p, j);
    if (p.causal && kp > qp) return false;
    if (p.window && (diff_ge(qp, kp, p.window) || diff_ge(kp, qp, p.window))) return false;
    if (p.q_doc && p.q_doc[i] != p.k_doc[j]) return false;
    return true;
}

// The pair (query tile qt, key tile kt) of the summaries' tiles: hidden (no pair visible), visible (every pair),
// or partial; conservative, as crate::attention::mask::classify.
__device__ __forceinline__ int classify(const AttnProblem& p, u32 qt, u32 kt) {
    const TileSummary q = p.q_tiles[qt], k = p.k_tiles[kt];
    if (p.causal && k.pos_min > q.pos_max) return TILE_HIDDEN;
    if (p.window) {
        if (diff_ge(q.pos_min, k.pos_max, p.window)) return TILE_HIDDEN;
        if (!p.causal && diff_ge(k.pos_min, q.pos_max, p.window)) return TILE_HIDDEN;
    }
    bool docs = p.q_doc != nullptr;
    if (docs && (q.doc_max < k.doc_min || k.doc_max < q.doc_min)) return TILE_HIDDEN;
    bool causal_ok = !p.causal || k.pos_max <= q.pos_min;
    bool window_ok = !p.window || (!diff_ge(q.pos_max, k.pos_min, p.window) && !diff_ge(k.pos_max, q.pos_min, p.window));
    bool docs_ok = !docs || (q.doc_min == q.doc_max && k.doc_min == k.doc_max && q.doc_min == k.doc_min);
    return causal_ok && window_ok && docs_ok ? TILE_VISIBLE : TILE_PARTIAL;
}

// Element types chosen at run time by the general kernels (codes of ops/attention.rs).
#define DT_F32 0u
#define DT_BF16 1u
#define DT_F16 2u

__device__ __forceinline__ float load_any(const void* base, u64 i, u32 dt) {
    if (dt == DT_F32) return static_cast<const float*>(base)[i];
    if (dt == DT_BF16) return to_f32(static_cast<const bf16*>(base)[i]);
    return to_f32(static_cast<const f16*>(base)[i]);
}

template <typename T>
__device__ __forceinline__ void store_as(void* base, u64 i, float v, bool accumulate) {
    T* d = static_cast<T*>(base);
    d[i] = from_f32<T>(accumulate ? to_f32(d[i]) + v : v);
}

__device__ __forceinline__ void store_any(void* base, u64 i, u32 dt, float v, bool accumulate) {
    if (dt == DT_F32) {
        store_as<float>(base, i, v, accumulate);
    } else if (dt == DT_BF16) {
        store_as<bf16>(base, i, v, accumulate);
    } else {
        store_as<f16>(base, i, v, accumulate);
    }
}

// A gradient element written (or added to, GradMode::Accumulate) in its type G.
template <typename G>
__device__ __forceinline__ void store_grad(G* dst, float v, bool accumulate) {
    *dst = from_f32<G>(accumulate ? to_f32(*dst) + v : v);
}

// The tensor-core kernels' element type T (bf16 or f16): its mma and its packing of two f32 into an operand register.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2], const float (&c)[4]);
template <>
__device__ __forceinline__ void mma_16816<bf16>(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2],
                                                const float (&c)[4]) {
    mma_16816_bf16(d, a, b, c);
}
template <>
__device__ __forceinline__ void mma_16816<f16>(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2],
                                               const float (&c)[4]) {
    mma_16816_f16(d, a, b, c);
}
template <typename T>
__device__ __forceinline__ u32 pack2(float lo, float hi);
template <>
__device__ __forceinline__ u32 pack2<bf16>(float lo, float hi) {
    return pack_bf16x2(lo, hi);
}
template <>
__device__ __forceinline__ u32 pack2<f16>(float lo, float hi) {
    return pack_f16x2(lo, hi);
}
