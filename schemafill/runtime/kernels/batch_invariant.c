/* Batch-invariant kernels: attention over a KV arena, the residual add with RMSNorm, and the
 * projections' products (bf16; fp32 where AVX2 is).
 *
 * Attention:
 *
 * Every number a query row gets is computed by the same sequence of floating-point
 * operations whatever else is in the call: how many rows, which lane a row sits in,
 * how wide the arena is, and which slots around its own are masked. So a row of a tree
 * verification gets the bits a one-row AR step at the same position gets, provided its
 * visible keys sit in the arena in position order (the decoders lay MAIN out so).
 *
 * How: query rows sharing a KV head are computed side by side, one per lane (where a call
 * has few such rows, as a decoding step does, slots take the lanes instead), and every sum
 * is one chain in a fixed order, whichever lane it runs in —
 *   score(r, s) = fma chain over d = 0 .. hd-1 (q pre-scaled),
 *   max over visible slots (exact whatever the order),
 *   p = exp(score - max), l = sum of p in slot order,
 *   o[d] = fma chain over slots in slot order of p * v[s][d], then o / l.
 * A masked slot adds an exact zero (p = 0), so slots a row does not see, between the ones
 * it does, change nothing. Accumulation is fp32; keys and values are fp32 or bf16.
 */
#include <math.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16  /* query rows side by side */
#define NARROW_LANES 4  /* where a KV head has this few query rows (a one-token step): fewer idle lanes */
#define U 8    /* slots scored at once: independent fma chains */
#define DV 64  /* value dimensions accumulated at once */
#define SAME(x) (x)

static inline float from_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest even, as torch rounds fp32 to bf16 */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* exp(x) for x <= 0 by range reduction and a degree-6 polynomial (about 1 ulp), branch-free
 * so it vectorizes; exactly 0 below -87 (masked slots are -inf). */
static inline float exp_neg(float x) {
    float c = x > -87.0f ? x : -87.0f;
    float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  /* round to nearest */
    float r = fmaf(n, -0.693359375f, c);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.98756915e-4f;
    p = fmaf(p, r, 1.39819994e-3f);
    p = fmaf(p, r, 8.33345205e-3f);
    p = fmaf(p, r, 4.16657962e-2f);
    p = fmaf(p, r, 1.66666657e-1f);
    p = fmaf(p, r, 5.0e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return x > -87.0f ? p * scale : 0.0f;
}

/* One past the last visible slot of a mask row, or ``floor`` if none is at or past it: eight
 * slots a step (the rows of a causal prompt end far before the call's width). */
static inline int last_visible(const uint8_t *m, int S, int floor) {
    int s = S;
    while (s - 8 >= floor) {
        uint64_t word;
        memcpy(&word, m + s - 8, sizeof word);
        if (word) break;
        s -= 8;
    }
    for (; s > floor; s--) if (m[s - 1]) return s;
    return floor;
}

/* One block of up to L query rows (the first ``rows`` real) of one KV head: qT [hd][L]
 * (pre-scaled, lanes past the block's rows zero), bias [reach][L] (0 visible, -inf not),
 * P [reach][L] scratch, kbuf [U][hd] scratch; writes o [hd][L] unnormalized and l [L]. */
#define DEFINE_BLOCK(NAME, L, T, LOAD)                                                           \
static void NAME(int hd, int reach, const float *restrict qT, const float *restrict bias,       \
                 const T *restrict K, const T *restrict V, int64_t kss, float *restrict P,      \
                 float *restrict kbuf, float *restrict o, float *restrict l, int rows) {        \
    float m[L];                                                                                  \
    for (int j = 0; j < L; j++) { m[j] = -INFINITY; l[j] = 0.0f; }                              \
    for (int s0 = 0; s0 < reach; s0 += U) {                                                      \
        int un = reach - s0 < U ? reach - s0 : U;                                                \
        for (int u = 0; u < un; u++)                                                             \
            for (int d = 0; d < hd; d++) kbuf[u * hd + d] = LOAD(K[(s0 + u) * kss + d]);         \
        for (int u = un; u < U; u++)                                                             \
            for (int d = 0; d < hd; d++) kbuf[u * hd + d] = 0.0f;                                \
        float acc[U][L];                                                                         \
        for (int u = 0; u < U; u++) for (int j = 0; j < L; j++) acc[u][j] = 0.0f;                \
        for (int d = 0; d < hd; d++) {                                                           \
            const float *qd = qT + d * L;                                                        \
            _Pragma("GCC unroll 8")                                                              \
            for (int u = 0; u < U; u++) {                                                        \
                float kd = kbuf[u * hd + d];                                                     \
                _Pragma("omp simd")                                                              \
                for (int j = 0; j < L; j++) acc[u][j] = fmaf(kd, qd[j], acc[u][j]);              \
            }                                                                                    \
        }                                                                                        \
        for (int u = 0; u < un; u++) {                                                           \
            float *ps = P + (s0 + u) * L;                                                        \
            const float *bs = bias + (s0 + u) * L;                                               \
            for (int j = 0; j < L; j++) {                                                        \
                float x = acc[u][j] + bs[j];                                                     \
                ps[j] = x;                                                                       \
                m[j] = x > m[j] ? x : m[j];                                                      \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    for (int j = 0; j < L; j++) m[j] = m[j] == -INFINITY ? 0.0f : m[j];                          \
    for (int s = 0; s < reach; s++) {                                                            \
        float *ps = P + s * L;                                                                   \
        _Pragma("omp simd")                                                                      \
        for (int j = 0; j < L; j++) { float p = exp_neg(ps[j] - m[j]); ps[j] = p; l[j] += p; }   \
    }                                                                                            \
    /* values: rows in fours against 64 dimensions of each slot's value row (converted once    \
     * for the four), one fma chain over slots per (row, dimension) */                           \
    for (int d0 = 0; d0 < hd; d0 += DV) {                                                        \
        int dn = hd - d0 < DV ? hd - d0 : DV;                                                    \
        for (int j0 = 0; j0 < rows; j0 += 4) {  /* fours holding a real row */                                                      \
            float acc[4][DV];                                                                    \
            for (int i = 0; i < 4; i++) for (int e = 0; e < DV; e++) acc[i][e] = 0.0f;           \
            for (int s = 0; s < reach; s++) {                                                    \
                const T *vs = V + s * kss + d0;                                                  \
                float vf[DV];                                                                    \
                if (dn == DV) for (int e = 0; e < DV; e++) vf[e] = LOAD(vs[e]);                  \
                else for (int e = 0; e < DV; e++) vf[e] = e < dn ? LOAD(vs[e]) : 0.0f;           \
                const float *p = P + s * L + j0;                                                 \
                _Pragma("GCC unroll 4")                                                          \
                for (int i = 0; i < 4; i++) {                                                    \
                    float pi = p[i];                                                             \
                    for (int e = 0; e < DV; e++) acc[i][e] = fmaf(vf[e], pi, acc[i][e]);         \
                }                                                                                \
            }                                                                                    \
            for (int i = 0; i < 4; i++) for (int e = 0; e < dn; e++) o[(d0 + e) * L + j0 + i] = acc[i][e]; \
        }                                                                                        \
    }                                                                                            \
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* Few query rows of one KV head (a decoding step's G rows, a small tree's): slots side by
 * side instead, 16 slots a vector, so no lane idles whatever the row count, and the keys and
 * values are read once for all the rows. A row's score for a slot is still one fma chain over
 * d = 0 .. hd-1, its max, exponentials, sum and value chains the ones the row-lane blocks run,
 * in the same order: the same bits (what the blocks' callers pick between may differ per call).
 * The keys come 16 slots at a time, transposed in registers. */
#define SLOT_ROWS 96  /* a KV head's rows up to which slots take the lanes (past it, a causal prompt's rows reach
                       * so differently that row blocks, each to its own reach, do less) */
#define SLOT_WIDTH(hd) ((hd) % 32 == 0)  /* whole 16-lane transposes in either dtype */

/* r[i][j] <- r[j][i] for 16 vectors of 16 dwords: the off-diagonal halves, quarters, eighths
 * and sixteenths swapped in turn */
static inline __attribute__((always_inline)) void swap_blocks(__m512i r[16], const int h) {
    int lo[16], hi[16];
    for (int c = 0; c < 16; c++) {
        lo[c] = c & h ? 16 + c - h : c;
        hi[c] = c & h ? 16 + c : c + h;
    }
    const __m512i li = _mm512_loadu_si512(lo), hj = _mm512_loadu_si512(hi);
    _Pragma("GCC unroll 16")
    for (int i = 0; i < 16; i++)
        if (!(i & h)) {
            __m512i a = r[i], b = r[i + h];
            r[i] = _mm512_permutex2var_epi32(a, li, b);
            r[i + h] = _mm512_permutex2var_epi32(a, hj, b);
        }
}

static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    swap_blocks(r, 8);
    swap_blocks(r, 4);
    swap_blocks(r, 2);
    swap_blocks(r, 1);
}

/* kT [hd][16] fp32: the keys of ``un`` slots (the rest zero) turned so that a slot is a lane */
static inline void keys_across_bf16(const uint16_t *K, int64_t kss, int hd, int un, float *kT) {
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int u = 0; u < 16; u++)  /* the next block's keys, while these are turned */
        for (int c = 0; c < hd; c += 32) _mm_prefetch((const char *)(K + (16 + u) * kss + c), _MM_HINT_T0);
    for (int c = 0; c < hd; c += 32) {
        __m512i r[16];
        _Pragma("GCC unroll 16")
        for (int u = 0; u < 16; u++) r[u] = u < un ? _mm512_loadu_si512(K + u * kss + c) : _mm512_setzero_si512();
        transpose16(r);  /* r[p]: dimensions c + 2p (low half) and c + 2p + 1 (high half) of each slot */
        _Pragma("GCC unroll 16")
        for (int p = 0; p < 16; p++) {
            _mm512_store_ps(kT + (c + 2 * p) * 16, _mm512_castsi512_ps(_mm512_slli_epi32(r[p], 16)));
            _mm512_store_ps(kT + (c + 2 * p + 1) * 16, _mm512_castsi512_ps(_mm512_and_si512(r[p], high)));
        }
    }
}

static inline void keys_across_f32(const float *K, int64_t kss, int hd, int un, float *kT) {
    for (int c = 0; c < hd; c += 16) {
        __m512i r[16];
        _Pragma("GCC unroll 16")
        for (int u = 0; u < 16; u++) r[u] = u < un ? _mm512_loadu_si512(K + u * kss + c) : _mm512_setzero_si512();
        transpose16(r);
        _Pragma("GCC unroll 16")
        for (int d = 0; d < 16; d++) _mm512_store_si512(kT + (c + d) * 16, r[d]);
    }
}

static inline __m512 value16_bf16(const uint16_t *v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)v)), 16));
}

static inline __m512 value16_f32(const float *v) { return _mm512_loadu_ps(v); }

/* S[i][0..15] = the scores of ``rows`` rows (qs [rows][hd]) against kT's 16 slots */
static inline __attribute__((always_inline)) void slot_scores(const int rows, int hd, const float *restrict kT,
                                                              const float *restrict qs, float *restrict S, int64_t ss) {
    __m512 acc[8];
    for (int i = 0; i < rows; i++) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d++) {
        const __m512 k = _mm512_load_ps(kT + d * 16);
        for (int i = 0; i < rows; i++) acc[i] = _mm512_fmadd_ps(k, _mm512_set1_ps(qs[i * hd + d]), acc[i]);
    }
    for (int i = 0; i < rows; i++) _mm512_store_ps(S + i * ss, acc[i]);
}

#define SCORES(R) static void scores##R(int hd, const float *kT, const float *qs, float *S, int64_t ss) { \
    slot_scores(R, hd, kT, qs, S, ss); }
SCORES(1) SCORES(2) SCORES(3) SCORES(4) SCORES(5) SCORES(6) SCORES(7) SCORES(8)
typedef void (*scores_fn)(int, const float *, const float *, float *, int64_t);
static const scores_fn SCORES_OF[9] = {0, scores1, scores2, scores3, scores4, scores5, scores6, scores7, scores8};

/* o[i][0 .. 16·nv) = the fma chain over slots of p[i][s] · v[s] for ``rows`` rows */
#define DEFINE_SLOT_VALUES(NAME, T, VALUE16)                                                     \
static inline __attribute__((always_inline)) void NAME##_of(const int rows, const int nv, int reach, \
        const T *restrict V, int64_t kss, const float *restrict P, int64_t ps, float *restrict o, int hd) { \
    __m512 acc[4][4];                                                                            \
    for (int i = 0; i < rows; i++) for (int c = 0; c < nv; c++) acc[i][c] = _mm512_setzero_ps(); \
    for (int s = 0; s < reach; s++) {                                                            \
        _mm_prefetch((const char *)(V + (s + 8) * kss), _MM_HINT_T0);                            \
        __m512 vf[4];                                                                            \
        for (int c = 0; c < nv; c++) vf[c] = VALUE16(V + s * kss + 16 * c);                      \
        for (int i = 0; i < rows; i++) {                                                         \
            const __m512 p = _mm512_set1_ps(P[i * ps + s]);                                      \
            for (int c = 0; c < nv; c++) acc[i][c] = _mm512_fmadd_ps(vf[c], p, acc[i][c]);       \
        }                                                                                        \
    }                                                                                            \
    for (int i = 0; i < rows; i++) for (int c = 0; c < nv; c++) _mm512_storeu_ps(o + i * hd + 16 * c, acc[i][c]); \
}                                                                                                \
static void NAME(int rows, int nv, int reach, const T *V, int64_t kss, const float *P, int64_t ps, float *o, int hd) { \
    switch (rows * 4 + nv - 5) {  /* every (rows, nv) its own registers */                       \
    case 0: NAME##_of(1, 1, reach, V, kss, P, ps, o, hd); break;                                 \
    case 1: NAME##_of(1, 2, reach, V, kss, P, ps, o, hd); break;                                 \
    case 2: NAME##_of(1, 3, reach, V, kss, P, ps, o, hd); break;                                 \
    case 3: NAME##_of(1, 4, reach, V, kss, P, ps, o, hd); break;                                 \
    case 4: NAME##_of(2, 1, reach, V, kss, P, ps, o, hd); break;                                 \
    case 5: NAME##_of(2, 2, reach, V, kss, P, ps, o, hd); break;                                 \
    case 6: NAME##_of(2, 3, reach, V, kss, P, ps, o, hd); break;                                 \
    case 7: NAME##_of(2, 4, reach, V, kss, P, ps, o, hd); break;                                 \
    case 8: NAME##_of(3, 1, reach, V, kss, P, ps, o, hd); break;                                 \
    case 9: NAME##_of(3, 2, reach, V, kss, P, ps, o, hd); break;                                 \
    case 10: NAME##_of(3, 3, reach, V, kss, P, ps, o, hd); break;                                \
    case 11: NAME##_of(3, 4, reach, V, kss, P, ps, o, hd); break;                                \
    case 12: NAME##_of(4, 1, reach, V, kss, P, ps, o, hd); break;                                \
    case 13: NAME##_of(4, 2, reach, V, kss, P, ps, o, hd); break;                                \
    case 14: NAME##_of(4, 3, reach, V, kss, P, ps, o, hd); break;                                \
    default: NAME##_of(4, 4, reach, V, kss, P, ps, o, hd); break;                                \
    }                                                                                            \
}

/* All R rows of one KV head over ``reach`` slots: qs [R][hd] (pre-scaled), mrow[j] each row's
 * mask row, P [R][rp] and kT [hd][16] scratch; writes o [R][hd] unnormalized and l [R]. */
#define DEFINE_SLOT_BLOCK(NAME, T, LOAD, STORE, KEYS_ACROSS, VALUES)                            \
static void NAME(int hd, int reach, int R, const float *restrict qs, const uint8_t *const *mrow, \
                 const T *restrict K, const T *restrict V, int64_t kss, float *restrict P, int64_t rp, \
                 float *restrict kT, float *restrict o, float *restrict l) {                     \
    for (int s0 = 0; s0 < reach; s0 += 16) {                                                     \
        KEYS_ACROSS(K + s0 * kss, kss, hd, reach - s0 < 16 ? reach - s0 : 16, kT);               \
        for (int j0 = 0; j0 < R; j0 += 8)                                                        \
            SCORES_OF[R - j0 < 8 ? R - j0 : 8](hd, kT, qs + j0 * hd, P + j0 * rp + s0, rp);      \
    }                                                                                            \
    for (int j = 0; j < R; j++) {                                                                \
        float *ps = P + j * rp, m = -INFINITY, sum = 0.0f;                                       \
        const uint8_t *mj = mrow[j];                                                             \
        for (int s = 0; s < reach; s++) {                                                        \
            float x = ps[s] + (mj[s] ? 0.0f : -INFINITY);                                        \
            ps[s] = x;                                                                           \
            m = x > m ? x : m;                                                                   \
        }                                                                                        \
        m = m == -INFINITY ? 0.0f : m;                                                           \
        _Pragma("omp simd")                                                                      \
        for (int s = 0; s < reach; s++) ps[s] = exp_neg(ps[s] - m);                              \
        for (int s = 0; s < reach; s++) sum += ps[s];  /* in slot order */                       \
        l[j] = sum;                                                                              \
    }                                                                                            \
    for (int d0 = 0; d0 < hd; d0 += DV)                                                          \
        for (int j0 = 0; j0 < R; j0 += 4)                                                        \
            VALUES(R - j0 < 4 ? R - j0 : 4, (hd - d0 < DV ? hd - d0 : DV) / 16, reach, V + d0, kss, \
                   P + j0 * rp, rp, o + j0 * hd + d0, hd);                                       \
}                                                                                                \
/* KV head g of batch row b: its R query rows (row r: token r / G, query head g·G + r % G) */    \
static void NAME##_head(int b, int g, int R, int G, int hd, const T *q, int64_t qsb, int64_t qst, \
                        int64_t qsh, const T *K, const T *V, int64_t kss, const uint8_t *mask,   \
                        int64_t msb, int64_t mst, int S, T *out, int64_t osb, int64_t ost,       \
                        int64_t osh, float scale) {                                              \
    const uint8_t *mrow[SLOT_ROWS];                                                              \
    int reach = 0;                                                                               \
    for (int j = 0; j < R; j++) {                                                                \
        mrow[j] = mask + b * msb + j / G * mst;                                                  \
        reach = last_visible(mrow[j], S, reach);                                                 \
    }                                                                                            \
    const int64_t rp = (reach + 15) / 16 * 16;                                                   \
    const size_t floats = (size_t)R * (2 * hd + rp) + 16 * hd + SLOT_ROWS;                       \
    float *buf = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);                     \
    float *qs = buf, *o = qs + R * hd, *kT = o + R * hd, *P = kT + 16 * hd, *l = P + R * rp;     \
    for (int j = 0; j < R; j++) {                                                                \
        const T *qr = q + b * qsb + j / G * qst + (g * G + j % G) * qsh;                         \
        for (int d = 0; d < hd; d++) qs[j * hd + d] = LOAD(qr[d]) * scale;                       \
    }                                                                                            \
    NAME(hd, reach, R, qs, mrow, K, V, kss, P, rp, kT, o, l);                                    \
    for (int j = 0; j < R; j++) {                                                                \
        T *od = out + b * osb + j / G * ost + (g * G + j % G) * osh;                             \
        for (int d = 0; d < hd; d++) od[d] = STORE(o[j * hd + d] / l[j]);                        \
    }                                                                                            \
    free(buf);                                                                                   \
}

DEFINE_SLOT_VALUES(slot_values_bf16, uint16_t, value16_bf16)
DEFINE_SLOT_VALUES(slot_values_f32, float, value16_f32)
DEFINE_SLOT_BLOCK(slot_block_bf16, uint16_t, from_bf16, to_bf16, keys_across_bf16, slot_values_bf16)
DEFINE_SLOT_BLOCK(slot_block_f32, float, SAME, SAME, keys_across_f32, slot_values_f32)
#else  /* row lanes only */
#define SLOT_ROWS 0
#define SLOT_WIDTH(hd) 0
#define slot_block_bf16_head(...) abort()
#define slot_block_f32_head(...) abort()
#endif

/* One attention call (``attend_*``): q [B, Tq, Hq, hd] and out strided; per batch row the
 * addresses of its arena row's keys and values (kbase, vbase; ksh, kss: their KV-head and slot
 * strides); mask [B, Tq, S]. Its work splits into items, each one KV head of one batch row
 * (with row lanes, one block of its rows), run in any order on any thread. */
typedef struct {
    int B, Tq, Hq, Hkv, hd, S;
    const void *q; int64_t qsb, qst, qsh;
    const int64_t *kbase, *vbase; int64_t ksh, kss;
    const uint8_t *mask; int64_t msb, mst;
    void *out; int64_t osb, ost, osh;
    float scale;
} attn_call;

static inline int slotwise(const attn_call *a) {
    return a->Hq / a->Hkv * a->Tq <= SLOT_ROWS && SLOT_WIDTH(a->hd);
}

static inline int lanes(const attn_call *a) { return a->Hq / a->Hkv * a->Tq <= NARROW_LANES ? NARROW_LANES : LANES; }

static inline int row_blocks(const attn_call *a) {
    return slotwise(a) ? 1 : (a->Hq / a->Hkv * a->Tq + lanes(a) - 1) / lanes(a);
}

static inline int64_t attn_items(const attn_call *a) { return (int64_t)a->B * a->Hkv * row_blocks(a); }

#define DEFINE_ATTEND(NAME, T, LOAD, STORE, BLOCK, NARROW, SLOT_HEAD)                            \
DEFINE_BLOCK(BLOCK, LANES, T, LOAD)                                                              \
DEFINE_BLOCK(NARROW, NARROW_LANES, T, LOAD)                                                      \
static void NAME##_item(const attn_call *a, int64_t it) {                                        \
    const int G = a->Hq / a->Hkv, R = G * a->Tq, L = lanes(a), nrb = row_blocks(a), hd = a->hd;  \
    const int b = (int)(it / ((int64_t)a->Hkv * nrb));                                           \
    const int g = (int)(it / nrb % a->Hkv), rb = (int)(it % nrb);                                \
    const T *q = a->q, *K = (const T *)(intptr_t)a->kbase[b] + g * a->ksh;                       \
    const T *V = (const T *)(intptr_t)a->vbase[b] + g * a->ksh;                                  \
    T *out = a->out;                                                                             \
    if (slotwise(a)) {                                                                           \
        SLOT_HEAD(b, g, R, G, hd, q, a->qsb, a->qst, a->qsh, K, V, a->kss, a->mask, a->msb, a->mst, a->S, \
                  out, a->osb, a->ost, a->osh, a->scale);                                        \
        return;                                                                                  \
    }                                                                                            \
    const uint8_t *mask = a->mask + b * a->msb;                                                  \
    int rows = R - rb * L < L ? R - rb * L : L, reach = 0;                                       \
    for (int j = 0; j < rows; j++) reach = last_visible(mask + (rb * L + j) / G * a->mst, a->S, reach); \
    float *buf = aligned_alloc(64, sizeof(float) * ((size_t)(2 * reach + 2 * hd + 1) * L + U * hd + 64)); \
    float *qT = buf, *o = qT + hd * L, *bias = o + hd * L, *P = bias + (size_t)reach * L;       \
    float *kbuf = P + (size_t)reach * L, *l = kbuf + U * hd;                                     \
    for (int j = 0; j < L; j++) {                                                                \
        int r = rb * L + j;                                                                      \
        const T *qr = q + b * a->qsb + r / G * a->qst + (g * G + r % G) * a->qsh;                \
        for (int d = 0; d < hd; d++) qT[d * L + j] = j < rows ? LOAD(qr[d]) * a->scale : 0.0f;   \
    }                                                                                            \
    const uint8_t *mrow[LANES];  /* each lane's mask row (idle lanes: the first row's, masked below) */ \
    for (int j = 0; j < L; j++) mrow[j] = mask + (j < rows ? (rb * L + j) / G : 0) * a->mst;     \
    for (int s = 0; s < reach; s++)                                                              \
        for (int j = 0; j < L; j++) bias[s * L + j] = j < rows && mrow[j][s] ? 0.0f : -INFINITY; \
    (L == LANES ? BLOCK : NARROW)(hd, reach, qT, bias, K, V, a->kss, P, kbuf, o, l, rows);       \
    for (int j = 0; j < rows; j++) {                                                             \
        int r = rb * L + j;                                                                      \
        T *od = out + b * a->osb + r / G * a->ost + (g * G + r % G) * a->osh;                    \
        for (int d = 0; d < hd; d++) od[d] = STORE(o[d * L + j] / l[j]);                         \
    }                                                                                            \
    free(buf);                                                                                   \
}                                                                                                \
void NAME(int B, int Tq, int Hq, int Hkv, int hd,                                                \
          const T *q, int64_t qsb, int64_t qst, int64_t qsh,                                     \
          const int64_t *kbase, const int64_t *vbase, int64_t ksh, int64_t kss,                  \
          const uint8_t *mask, int64_t msb, int64_t mst, int S,                                  \
          T *out, int64_t osb, int64_t ost, int64_t osh, float scale) {                           \
    const attn_call a = {B, Tq, Hq, Hkv, hd, S, q, qsb, qst, qsh, kbase, vbase, ksh, kss, mask, msb, mst, \
                         out, osb, ost, osh, scale};                                             \
    const int64_t items = attn_items(&a);                                                        \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                             \
    for (int64_t it = 0; it < items; it++) NAME##_item(&a, it);                                  \
}

/* The new tokens of one attention call: k, v [B, T, Hkv, hd] and the unrotated q [B, T, Hq,
 * hd] strided, rotary tables cos, sin [B, T, hd] strided, slots [B, T] (where each token's key
 * and value go in its batch row's arena row), and where the rotated queries go (qbuf
 * [B, T, Hq, hd], the attention call's q). */
typedef struct {
    const void *q; int64_t qsb, qst, qsh;
    const void *k; int64_t ksb, kst, ksh;
    const void *v; int64_t vsb, vst, vsh;
    const void *cs, *sn; int64_t csb, cst;
    const int64_t *slots; int64_t ssb;
    void *qbuf;
} rope_call;

/* Rotary on new keys and queries, new keys and values into the arena, then attention, in one
 * call: x' = x * cos + roll(x, hd/2) * sin_signed per head, each product and the sum rounded to
 * T as torch's T ops round them (sin_signed: the sine with its first half negated). q, k, v:
 * [B, T, heads, hd] strided; cos, sin: [B, T, hd] strided; slots [B, T]: where each token's
 * key and value go in its batch row's arena row. */
#define DEFINE_ROPE_ATTEND(NAME, ATTEND, T, LOAD, STORE)                                          \
static inline void NAME##_rotate(const T *x, const T *c, const T *sn, int hd, T *y) {             \
    int half = hd / 2;                                                                           \
    for (int d = 0; d < hd; d++) {                                                               \
        float rolled = LOAD(x[d < half ? d + half : d - half]);                                  \
        float a = LOAD(STORE(LOAD(x[d]) * LOAD(c[d])));                                          \
        float b = LOAD(STORE(rolled * LOAD(sn[d])));                                             \
        y[d] = STORE(a + b);                                                                     \
    }                                                                                            \
}                                                                                                \
static void NAME##_token(const attn_call *a, const rope_call *r, int64_t bt) {                   \
    const int b = (int)(bt / a->Tq), t = (int)(bt % a->Tq), hd = a->hd;                          \
    const T *c = (const T *)r->cs + b * r->csb + t * r->cst, *sv = (const T *)r->sn + b * r->csb + t * r->cst; \
    const int64_t slot = r->slots[b * r->ssb + t];                                               \
    T *K = (T *)(intptr_t)a->kbase[b], *V = (T *)(intptr_t)a->vbase[b];                          \
    for (int h = 0; h < a->Hkv; h++) {                                                           \
        NAME##_rotate((const T *)r->k + b * r->ksb + t * r->kst + h * r->ksh, c, sv, hd,         \
                      K + h * a->ksh + slot * a->kss);                                           \
        const T *vin = (const T *)r->v + b * r->vsb + t * r->vst + h * r->vsh;                   \
        T *vout = V + h * a->ksh + slot * a->kss;                                                \
        for (int d = 0; d < hd; d++) vout[d] = vin[d];                                           \
    }                                                                                            \
    for (int h = 0; h < a->Hq; h++)                                                              \
        NAME##_rotate((const T *)r->q + b * r->qsb + t * r->qst + h * r->qsh, c, sv, hd,         \
                      (T *)r->qbuf + bt * a->Hq * hd + h * hd);                                  \
}                                                                                                \
void NAME(int B, int Tq, int Hq, int Hkv, int hd,                                                \
          const T *q, int64_t qsb, int64_t qst, int64_t qsh,                                     \
          const T *k, int64_t ksb, int64_t kst, int64_t ksh_in,                                  \
          const T *v, int64_t vsb, int64_t vst, int64_t vsh,                                     \
          const T *cs, const T *sn, int64_t csb, int64_t cst,                                    \
          const int64_t *slots, int64_t ssb,                                                     \
          const int64_t *kbase, const int64_t *vbase, int64_t ksh, int64_t kss,                  \
          const uint8_t *mask, int64_t msb, int64_t mst, int S,                                  \
          T *qbuf, T *out, int64_t osb, int64_t ost, int64_t osh, float scale) {                 \
    const attn_call a = {B, Tq, Hq, Hkv, hd, S, qbuf, (int64_t)Tq * Hq * hd, (int64_t)Hq * hd, hd, kbase, vbase, \
                         ksh, kss, mask, msb, mst, out, osb, ost, osh, scale};                   \
    const rope_call r = {q, qsb, qst, qsh, k, ksb, kst, ksh_in, v, vsb, vst, vsh, cs, sn, csb, cst, slots, ssb, qbuf}; \
    _Pragma("omp parallel for if (B * Tq > 16)")                                                 \
    for (int64_t bt = 0; bt < (int64_t)B * Tq; bt++) NAME##_token(&a, &r, bt);                   \
    const int64_t items = attn_items(&a);                                                        \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                             \
    for (int64_t it = 0; it < items; it++) ATTEND##_item(&a, it);                                \
}

DEFINE_ATTEND(attend_f32, float, SAME, SAME, block_f32, narrow_f32, slot_block_f32_head)
DEFINE_ATTEND(attend_bf16, uint16_t, from_bf16, to_bf16, block_bf16, narrow_bf16, slot_block_bf16_head)

/* Residual add and RMSNorm of rows, as torch's ops in the rows' dtype round them: s = x + y (y may
 * be NULL: s = x), then out = w * (s * r) with r = 1 / sqrt(mean(s²) + eps) in fp32, the squares
 * summed in sixteen lanes in order; in bf16 each of s, s * r and out rounded to bf16 (ROUND).
 * Row by row, the same operations for every row. */
#define ROUND_BF16(x) from_bf16(to_bf16(x))
#define DEFINE_ADD_RMS_NORM(NAME, T, LOAD, STORE, ROUND)                                          \
void NAME(int64_t rows, int dim, const T *x, int64_t xs, const T *y, int64_t ys,                   \
          const T *w, float eps, T *sum, int64_t ss, T *out, int64_t os) {                         \
    _Pragma("omp parallel for if (rows > 16)")                                                     \
    for (int64_t r = 0; r < rows; r++) {                                                           \
        const T *xr = x + r * xs, *yr = y ? y + r * ys : NULL;                                     \
        T *sr = sum + r * ss, *orow = out + r * os;                                                \
        float acc[16] = {0};  /* lane l sums the squares of elements l, l + 16, ... in order */   \
        for (int i0 = 0; i0 < dim; i0 += 16) {                                                     \
            int n = dim - i0 < 16 ? dim - i0 : 16;                                                 \
            _Pragma("omp simd")                                                                    \
            for (int l = 0; l < n; l++) {                                                          \
                float v = LOAD(xr[i0 + l]);                                                        \
                if (yr) v = ROUND(v + LOAD(yr[i0 + l]));                                           \
                sr[i0 + l] = STORE(v);                                                             \
                acc[l] = fmaf(v, v, acc[l]);                                                       \
            }                                                                                      \
        }                                                                                          \
        float t8[8], t4[4];                                                                        \
        for (int l = 0; l < 8; l++) t8[l] = acc[l] + acc[l + 8];                                   \
        for (int l = 0; l < 4; l++) t4[l] = t8[l] + t8[l + 4];                                     \
        float inv = 1.0f / sqrtf(((t4[0] + t4[2]) + (t4[1] + t4[3])) / (float)dim + eps);          \
        _Pragma("omp simd")                                                                        \
        for (int i = 0; i < dim; i++) orow[i] = STORE(LOAD(w[i]) * ROUND(LOAD(sr[i]) * inv));     \
    }                                                                                              \
}

DEFINE_ADD_RMS_NORM(add_rms_norm_f32, float, SAME, SAME, SAME)
DEFINE_ADD_RMS_NORM(add_rms_norm_bf16, uint16_t, from_bf16, to_bf16, ROUND_BF16)

DEFINE_ROPE_ATTEND(rope_attend_f32, attend_f32, float, SAME, SAME)
DEFINE_ROPE_ATTEND(rope_attend_bf16, attend_bf16, uint16_t, from_bf16, to_bf16)

/* Products y = x Wᵀ + bias of bf16 rows against bf16 weights, fp32 accumulation: every output
 * element is one fp32 accumulator walked over k = 0, 2, 4, ... in order (each step adds the
 * pair k, k+1), whatever the call's row count or how rows and columns are tiled, so a row gets
 * the same bits alone or among many. One pass streams the weights once for up to ROWS rows.
 *
 * Layout (``pack_bf16``): the N outputs in groups of COLS = TILES·16 (the last padded with
 * zeros); per group, per pair p of inputs, TILES vectors of 16 outputs × (k = 2p, 2p + 1),
 * interleaved as the bf16 dot-product instruction reads them — each group one contiguous run
 * of K·COLS weights. Built only where 512-bit vectors are (``product_tiles`` says 0 elsewhere). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TILES 3  /* 48 outputs a group: the projections of hidden sizes 576, 960, 3072 split evenly */
#define ROWS 8   /* rows a pass: ROWS·TILES accumulators + TILES weights + 1 broadcast of 32 registers */
#define CHUNK 64 /* rows whose inputs stay in cache while every group streams past them */

int product_tiles(void) { return TILES; }

void pack_bf16(int64_t N, int64_t K, const uint16_t *W, uint16_t *P) {
    const int64_t groups = (N + 16 * TILES - 1) / (16 * TILES), pairs = K / 2;
    #pragma omp parallel for
    for (int64_t g = 0; g < groups; g++)
        for (int64_t p = 0; p < pairs; p++)
            for (int t = 0; t < TILES; t++)
                for (int o = 0; o < 16; o++) {
                    int64_t n = (g * TILES + t) * 16 + o;
                    uint16_t *to = P + ((g * pairs + p) * TILES + t) * 32 + 2 * o;
                    to[0] = n < N ? W[n * K + 2 * p] : 0;
                    to[1] = n < N ? W[n * K + 2 * p + 1] : 0;
                }
}

/* acc + w[2i]·x[0] + w[2i+1]·x[1] per lane i */
static inline __m512 dot2(__m512 acc, __m512i w, __m512i x) {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
#else  /* no bf16 dot: the two products as fp32 fmas, high element first as the instruction adds them */
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(w, high)),
                          _mm512_castsi512_ps(_mm512_and_si512(x, high)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(w, 16)),
                           _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)), acc);
#endif
}

static inline void store_bf16(uint16_t *y, __m512 v, int n) {  /* to nearest even, as to_bf16 */
#if defined(__AVX512BF16__)
    __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
    if (n >= 16) _mm256_storeu_si256((__m256i *)y, h);
    else _mm256_mask_storeu_epi16(y, (__mmask16)((1u << n) - 1), h);
}

static inline __attribute__((always_inline)) void product_pass(
        const int R, int64_t pairs, const uint16_t *restrict Pg, const uint16_t *restrict x, int64_t xs,
        const float *restrict bias, uint16_t *restrict y, int64_t ys, int64_t n0, int64_t N) {
    __m512 acc[ROWS][TILES];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TILES; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        __m512i w[TILES];
        for (int t = 0; t < TILES; t++) w[t] = _mm512_loadu_si512(Pg + (p * TILES + t) * 32);
        for (int r = 0; r < R; r++) {
            uint32_t pair;
            memcpy(&pair, x + r * xs + 2 * p, sizeof pair);
            __m512i b = _mm512_set1_epi32((int)pair);
            for (int t = 0; t < TILES; t++) acc[r][t] = dot2(acc[r][t], w[t], b);
        }
    }
    for (int t = 0; t < TILES; t++) {
        int64_t n = n0 + 16 * t;
        if (n >= N) break;
        __m512 b = bias ? _mm512_loadu_ps(bias + 16 * t) : _mm512_setzero_ps();
        for (int r = 0; r < R; r++)
            store_bf16(y + r * ys + n, bias ? _mm512_add_ps(acc[r][t], b) : acc[r][t], (int)(N - n));
    }
}

#define PASS(R) static void pass##R(int64_t pairs, const uint16_t *Pg, const uint16_t *x, int64_t xs,   \
    const float *bias, uint16_t *y, int64_t ys, int64_t n0, int64_t N) {                            \
    product_pass(R, pairs, Pg, x, xs, bias, y, ys, n0, N); }
PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6) PASS(7) PASS(8)
typedef void (*pass_fn)(int64_t, const uint16_t *, const uint16_t *, int64_t, const float *, uint16_t *, int64_t,
                        int64_t, int64_t);
static const pass_fn PASSES[ROWS + 1] = {0, pass1, pass2, pass3, pass4, pass5, pass6, pass7, pass8};

/* x: [M, K] (row stride xs), P: ``pack_bf16`` of W [N, K], bias: [N + padding] fp32 or NULL,
 * y: [M, N] (row stride ys). K even. */
void product_bf16(int64_t M, int64_t N, int64_t K, const uint16_t *x, int64_t xs, const uint16_t *P,
                  const float *bias, uint16_t *y, int64_t ys) {
    const int64_t groups = (N + 16 * TILES - 1) / (16 * TILES), pairs = K / 2;
    const int64_t chunks = (M + CHUNK - 1) / CHUNK;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *Pg = P + g * pairs * TILES * 32;
            const float *bg = bias ? bias + g * 16 * TILES : NULL;
            int64_t end = (c + 1) * CHUNK < M ? (c + 1) * CHUNK : M;
            for (int64_t m = c * CHUNK; m < end; m += ROWS) {
                int R = end - m < ROWS ? (int)(end - m) : ROWS;
                PASSES[R](pairs, Pg, x + m * xs, xs, bg, y + m * ys, ys, g * 16 * TILES, N);
            }
        }
}
#else
int product_tiles(void) { return 0; }
#endif

/* Products y = x Wᵀ + bias of fp32 rows against fp32 weights: every output element is one fma
 * chain over k = 0 .. K-1 in order, whatever the call's row count or how rows and columns are
 * tiled, so a row gets the same bits alone or among many — and the same bits in 256-bit lanes as
 * in any other width. One pass streams the weights once for up to F32_ROWS rows; the rows of a
 * chunk pass over a group while it is still in cache. The BLAS's few-row kernels stream the
 * weights at under half the host's read rate; this one stays near it from one row to a few, and
 * past that is bound by the fmas.
 *
 * Layout (``pack_f32``): the N outputs in groups of F32_COLS = F32_TILES·8 (the last padded with
 * zeros); per group, per input k, F32_TILES vectors of 8 outputs — each group one contiguous run
 * of K·F32_COLS weights. Built where AVX2 and FMA are (``product_f32_cols`` says 0 elsewhere). */
#if defined(__AVX2__) && defined(__FMA__)
#define F32_TILES 3   /* 24 outputs a group: 576, 960, 1536, 3072 and 49152 split evenly */
#define F32_ROWS 4    /* rows a pass: F32_ROWS·F32_TILES accumulators + F32_TILES weights + 1 broadcast of 16 */
#define F32_COLS (8 * F32_TILES)
#define F32_CHUNK 64  /* rows whose inputs stay in cache while every group streams past them */

int product_f32_cols(void) { return F32_COLS; }

void pack_f32(int64_t N, int64_t K, const float *W, float *P) {
    const int64_t groups = (N + F32_COLS - 1) / F32_COLS;
    #pragma omp parallel for
    for (int64_t g = 0; g < groups; g++)
        for (int64_t k = 0; k < K; k++)
            for (int o = 0; o < F32_COLS; o++) {
                int64_t n = g * F32_COLS + o;
                P[(g * K + k) * F32_COLS + o] = n < N ? W[n * K + k] : 0.0f;
            }
}

static inline __attribute__((always_inline)) void product_f32_pass(
        const int R, int64_t K, const float *restrict Pg, const float *restrict x, int64_t xs,
        const float *restrict bias, float *restrict y, int64_t ys, int64_t n0, int64_t N) {
    __m256 acc[F32_ROWS][F32_TILES];
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 8
        for (int t = 0; t < F32_TILES; t++) acc[r][t] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 w[F32_TILES];
        #pragma GCC unroll 8
        for (int t = 0; t < F32_TILES; t++) w[t] = _mm256_loadu_ps(Pg + (k * F32_TILES + t) * 8);
        #pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m256 b = _mm256_broadcast_ss(x + r * xs + k);
            #pragma GCC unroll 8
            for (int t = 0; t < F32_TILES; t++) acc[r][t] = _mm256_fmadd_ps(w[t], b, acc[r][t]);
        }
    }
    /* out through a buffer of whole vectors: with no partial store among them, the compiler keeps
     * the accumulators in registers through the loop above instead of storing them every step */
    float out[F32_ROWS][F32_COLS];
    #pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 8
        for (int t = 0; t < F32_TILES; t++)
            _mm256_storeu_ps(out[r] + 8 * t, bias ? _mm256_add_ps(acc[r][t], _mm256_loadu_ps(bias + 8 * t)) : acc[r][t]);
    const int64_t width = N - n0 < F32_COLS ? N - n0 : F32_COLS;
    for (int r = 0; r < R; r++) memcpy(y + r * ys + n0, out[r], (size_t)width * sizeof(float));
}

#define F32_PASS(R) static void f32_pass##R(int64_t K, const float *Pg, const float *x, int64_t xs,       \
    const float *bias, float *y, int64_t ys, int64_t n0, int64_t N) {                                 \
    product_f32_pass(R, K, Pg, x, xs, bias, y, ys, n0, N); }
F32_PASS(1) F32_PASS(2) F32_PASS(3) F32_PASS(4)
typedef void (*f32_pass_fn)(int64_t, const float *, const float *, int64_t, const float *, float *, int64_t,
                            int64_t, int64_t);
static const f32_pass_fn F32_PASSES[F32_ROWS + 1] = {0, f32_pass1, f32_pass2, f32_pass3, f32_pass4};

/* x: [M, K] (row stride xs), P: ``pack_f32`` of W [N, K], bias: [N + padding] or NULL,
 * y: [M, N] (row stride ys). */
void product_f32(int64_t M, int64_t N, int64_t K, const float *x, int64_t xs, const float *P,
                 const float *bias, float *y, int64_t ys) {
    const int64_t groups = (N + F32_COLS - 1) / F32_COLS, chunks = (M + F32_CHUNK - 1) / F32_CHUNK;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t c = 0; c < chunks; c++)
        for (int64_t g = 0; g < groups; g++) {
            const float *Pg = P + g * K * F32_COLS;
            const float *bg = bias ? bias + g * F32_COLS : NULL;
            int64_t end = (c + 1) * F32_CHUNK < M ? (c + 1) * F32_CHUNK : M;
            for (int64_t m = c * F32_CHUNK; m < end; m += F32_ROWS) {
                int R = end - m < F32_ROWS ? (int)(end - m) : F32_ROWS;
                F32_PASSES[R](K, Pg, x + m * xs, xs, bg, y + m * ys, ys, g * F32_COLS, N);
            }
        }
}
#else
int product_f32_cols(void) { return 0; }
#endif

/* silu(gate) · up of bf16 halves, rounded as torch's bf16 ops round them: s = bf16(silu(g)) in
 * fp32, then bf16(s · u). silu(x) = x / (1 + e^-x), from e = exp(-|x|) so that the exponential's
 * argument is never positive (``exp_neg``, which vectorizes where libm's expf does not).
 * gu: [rows, 2·I] (gate, then up), out: [rows, I]. */
void silu_mul_bf16(int64_t rows, int64_t I, const uint16_t *gu, uint16_t *out) {
    #pragma omp parallel for if (rows * I > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * 2 * I, *u = g + I;
        uint16_t *o = out + r * I;
        for (int64_t i = 0; i < I; i++) {
            float x = from_bf16(g[i]);
            float e = exp_neg(-fabsf(x));
            float s = (x >= 0.0f ? x : x * e) / (1.0f + e);
            o[i] = to_bf16(from_bf16(to_bf16(s)) * from_bf16(u[i]));
        }
    }
}

/* silu(gate) · up of fp32 rows, from e = exp(-|x|) as ``silu_mul_bf16`` computes it.
 * gu: [rows, 2·I] (gate, then up), out: [rows, I]. */
void silu_mul_f32(int64_t rows, int64_t I, const float *gu, float *out) {
    #pragma omp parallel for if (rows * I > 16384)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *o = out + r * I;
        #pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            float x = g[i];
            float e = exp_neg(-fabsf(x));
            o[i] = (x >= 0.0f ? x : x * e) / (1.0f + e) * u[i];
        }
    }
}

/* One decoder layer of a target in one call (Llama, Mistral, Qwen2: no Q/K norms), the same
 * kernels in the same order as the runtime calls them one by one:
 *   qkv = h Wqkvᵀ; rotary, KV writes and attention per group; x, h = add_rms_norm(x, attn Woᵀ);
 *   x, h = add_rms_norm(x, (silu(gate) · up) Wdownᵀ) with the next norm's weight.
 * x (the residual stream) and h (its norm) are updated in place. A group is one attention call:
 * B batch rows of T tokens, rows [row0, row0 + B·T) of the call, with their own arena rows,
 * slots, mask and rotary tables. Built per dtype where its product is (``layer_bf16``: 512-bit
 * vectors; ``layer_f32``: AVX2). */
typedef struct {
    int64_t B, T, S, row0;
    const int64_t *slots; int64_t ssb;
    const int64_t *kv;  /* [layers][2][B]: each batch row's arena row, keys then values */
    int64_t ksh, kss;   /* the arena's KV-head and slot strides */
    const uint8_t *mask; int64_t msb, mst;
    const void *cos, *sin; int64_t csb, cst;
} attn_group;

typedef struct { const void *w; const float *b; int64_t n, k; } packed_product;

typedef struct {
    int64_t rows, H, Hq, Hkv, hd, I, ngroups;
    float eps, scale;
    const attn_group *groups;
    void *qkv, *qbuf, *attn, *proj, *gu, *act;  /* scratch, in the layer's dtype */
} layer_call;

/* the i with first[i] <= x < first[i + 1] (first: n + 1 non-decreasing counts from 0) */
static inline int64_t group_of(const int64_t *first, int64_t n, int64_t x) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (first[mid] <= x) lo = mid; else hi = mid - 1;
    }
    return lo;
}

#define DEFINE_LAYER(NAME, TY, PRODUCT, ADD_RMS_NORM, SILU_MUL, ROPE_TOKEN, ATTEND_ITEM)                    \
static void NAME##_product(const packed_product *p, int64_t rows, const TY *x, TY *y) {                    \
    PRODUCT(rows, p->n, p->k, x, p->k, (const TY *)p->w, p->b, y, p->n);                                    \
}                                                                                                       \
void NAME(const layer_call *c, int64_t layer, const packed_product *qkv, const packed_product *o,        \
          const packed_product *gate_up, const packed_product *down, const TY *norm, const TY *next_norm,  \
          TY *x, TY *h) {                                                                                 \
    const int64_t n = c->rows, H = c->H, hd = c->hd, nq = (c->Hq + 2 * c->Hkv) * hd, qw = c->Hq * hd;   \
    TY *cqkv = c->qkv, *cqbuf = c->qbuf, *cattn = c->attn, *cproj = c->proj, *cgu = c->gu, *cact = c->act; \
    NAME##_product(qkv, n, h, cqkv);                                                                    \
    /* every group's rotary and KV writes, then every group's attention, each one parallel loop:        \
     * a batch's requests are groups of a few rows, too little work apiece to share two threads */      \
    const int64_t ng = c->ngroups;                                                                      \
    attn_call *calls = malloc(ng * sizeof *calls);                                                      \
    rope_call *ropes = malloc(ng * sizeof *ropes);                                                      \
    int64_t *token0 = malloc((ng + 1) * sizeof *token0), *item0 = malloc((ng + 1) * sizeof *item0);     \
    token0[0] = item0[0] = 0;                                                                           \
    for (int64_t i = 0; i < ng; i++) {                                                                  \
        const attn_group *g = c->groups + i;                                                            \
        const TY *q = cqkv + g->row0 * nq;                                                               \
        const int64_t *kv = g->kv + layer * 2 * g->B;                                                   \
        calls[i] = (attn_call){(int)g->B, (int)g->T, (int)c->Hq, (int)c->Hkv, (int)hd, (int)g->S,         \
                               cqbuf + g->row0 * qw, g->T * qw, qw, hd, kv, kv + g->B, g->ksh, g->kss,    \
                               g->mask, g->msb, g->mst, cattn + g->row0 * qw, g->T * qw, qw, hd, c->scale}; \
        ropes[i] = (rope_call){q, g->T * nq, nq, hd, q + qw, g->T * nq, nq, hd, q + qw + c->Hkv * hd,       \
                               g->T * nq, nq, hd, g->cos, g->sin, g->csb, g->cst, g->slots, g->ssb,       \
                               cqbuf + g->row0 * qw};                                                   \
        token0[i + 1] = token0[i] + g->B * g->T;                                                        \
        item0[i + 1] = item0[i] + attn_items(calls + i);                                                \
    }                                                                                                   \
    _Pragma("omp parallel for if (token0[ng] > 16)")                                                    \
    for (int64_t t = 0; t < token0[ng]; t++) {                                                          \
        int64_t i = group_of(token0, ng, t);                                                            \
        ROPE_TOKEN(calls + i, ropes + i, t - token0[i]);                                                \
    }                                                                                                   \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                                    \
    for (int64_t it = 0; it < item0[ng]; it++) {                                                        \
        int64_t i = group_of(item0, ng, it);                                                            \
        ATTEND_ITEM(calls + i, it - item0[i]);                                                          \
    }                                                                                                   \
    free(calls), free(ropes), free(token0), free(item0);                                                \
    NAME##_product(o, n, cattn, cproj);                                                                 \
    ADD_RMS_NORM(n, (int)H, x, H, cproj, H, norm, c->eps, x, H, h, H);                                  \
    NAME##_product(gate_up, n, h, cgu);                                                                 \
    SILU_MUL(n, c->I, cgu, cact);                                                                       \
    NAME##_product(down, n, cact, cproj);                                                               \
    ADD_RMS_NORM(n, (int)H, x, H, cproj, H, next_norm, c->eps, x, H, h, H);                             \
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
DEFINE_LAYER(layer_bf16, uint16_t, product_bf16, add_rms_norm_bf16, silu_mul_bf16, rope_attend_bf16_token,
             attend_bf16_item)
#endif
#if defined(__AVX2__) && defined(__FMA__)
DEFINE_LAYER(layer_f32, float, product_f32, add_rms_norm_f32, silu_mul_f32, rope_attend_f32_token,
             attend_f32_item)
#endif
