/* The turn-level estimators' token passes on the CPU (advantages/native_turns.py, issue 47).
 *
 * Row-major (rows, cols) arrays. spans: int8 SpanKind (0 PAD, 1 ASSISTANT, 2 OBSERVATION).
 * turn_ids: int16 or int64 (turn_kind 2 or 8), or absent (turn_kind 0: the k-th ASSISTANT run of a
 * row is turn k). An OBSERVATION token precedes turn (the last ASSISTANT turn before it) + 1, 0
 * before the first, as the torch path reads turn_ids + 1 there (validated turn ids agree).
 *
 * turn_tables: one pass, per (row, turn k < n): r = the sum of the rewards on turn k's ASSISTANT
 * tokens (in double, in token order), v = values at turn k's first ASSISTANT token (optional), and
 * two 64-bit hashes of the token ids + 1 of the OBSERVATION tokens before turn k, in order (unsigned
 * arithmetic wraps mod 2^64): a polynomial one, h = h * B1 + x, and FNV-1a over whole tokens,
 * h = (h ^ x) * FNV. Each is one multiply per token (the torch path's mod-prime hashes cost a
 * 128-bit product and a reduction here); two of different kinds make a chance merge ~2^-128, and
 * gigpo's validation compares the tokens anyway. turn_broadcast: per token, the (rows, n) double
 * tables' values at the token's turn on ASSISTANT tokens, exactly 0 elsewhere, in the outputs'
 * type (one or two outputs per pass). Turn ids outside [0, n) are skipped.
 *
 * Sessions (advantages/sessions.py, issue 54 item 6): with order, previous and carry, turn_tables
 * reads the rows in order (every row after its session's previous segment) and hashes each row's
 * observations as the row joined after its session's earlier segments would: previous[row] is the
 * row of the session's previous segment (-1 for segment 0), carry (rows, 4) gets each row's hash
 * state (the three hashes and the length) of the observation before the turn after its last one
 * (zeros when ASSISTANT tokens follow its last observation), and a row starts from its previous
 * row's: the key of a later segment's first turn hashes the previous segments' trailing observation
 * tokens followed by its own opening ones, as on the joined row. */
#include <stdint.h>
#include <string.h>

#define B1 1000003ULL

static inline int64_t turn_at(const void *turn_ids, int turn_kind, int64_t i) {
    return turn_kind == 2 ? ((const int16_t *)turn_ids)[i] : ((const int64_t *)turn_ids)[i];
}

#define FNV 0x100000001b3ULL
#define B3 0x9E3779B97F4A7C15ULL /* the check hash (validation only): another base, tokens mixed */
#define MIX 0xD6E8FEB86659FD93ULL
#define STORE(k)                                                                                     \
    do {                                                                                             \
        h1[row * n + (k)] = (int64_t)a; h2[row * n + (k)] = (int64_t)b;                              \
        if (h3) { h3[row * n + (k)] = (int64_t)c; length[row * n + (k)] = (int64_t)m; }              \
    } while (0)
#define LOAD(k)                                                                                      \
    do {                                                                                             \
        a = (uint64_t)h1[row * n + (k)]; b = (uint64_t)h2[row * n + (k)];                            \
        if (h3) { c = (uint64_t)h3[row * n + (k)]; m = (uint64_t)length[row * n + (k)]; }            \
    } while (0)

/* count[row] = the row's number of turns (largest ASSISTANT turn id + 1); tables of n columns
 * (turns at n or beyond are skipped: the caller retries with more columns). A turn's reward sum is
 * kept in a register while its run lasts (no store-to-load chain through memory per token). */
#define TABLES(NAME, T)                                                                              \
    void NAME(const T *rewards, const T *values, const int8_t *spans, const void *turn_ids, int turn_kind, \
              const int64_t *tokens, int64_t rows, int64_t cols, int64_t n, double *r, double *v,    \
              int64_t *h1, int64_t *h2, int64_t *h3, int64_t *length, int64_t *count,                \
              const int64_t *order, const int64_t *previous, uint64_t *carry) {                       \
        memset(r, 0, sizeof(double) * rows * n);                                                     \
        if (h3) { memset(h3, 0, sizeof(int64_t) * rows * n); memset(length, 0, sizeof(int64_t) * rows * n); } \
        if (v) memset(v, 0, sizeof(double) * rows * n);                                              \
        if (tokens) { memset(h1, 0, sizeof(int64_t) * rows * n); memset(h2, 0, sizeof(int64_t) * rows * n); } \
        for (int64_t i = 0; i < rows; i++) {                                                         \
            const int64_t row = order ? order[i] : i;                                                \
            const int64_t base = row * cols;                                                         \
            double *rr = r + row * n;                                                                \
            int64_t last = -1, top = -1, current = -1; /* last ASSISTANT turn, largest, the run's */ \
            double sum = 0.0;                                                                        \
            uint64_t a = 0, b = 0, c = 0, m = 0; /* the hashes and length of the observation read */ \
            if (carry && previous[row] >= 0) {  /* the session's previous segment's trailing one */  \
                const uint64_t *in = carry + 4 * previous[row];                                      \
                a = in[0]; b = in[1]; c = in[2]; m = in[3];                                          \
            }                                                                                        \
            int64_t into = 0;      /* the turn it precedes */                                        \
            int previous = 0;                                                                        \
            for (int64_t t = 0; t < cols; t++) {                                                     \
                const int8_t s = spans[base + t];                                                    \
                if (s == 1) {                                                                        \
                    int64_t k = turn_kind ? turn_at(turn_ids, turn_kind, base + t)                   \
                                          : (previous ? last : last + 1);                            \
                    if (k != current) {                                                              \
                        if (current >= 0 && current < n) rr[current] += sum;                         \
                        sum = 0.0;                                                                   \
                        if (v && k >= 0 && k < n) v[row * n + k] = (double)values[base + t]; \
                        current = k;                                                                 \
                    }                                                                                \
                    sum += (double)rewards[base + t];                                                \
                    if (k > top) top = k;                                                            \
                    last = k;                                                                        \
                    previous = 1;                                                                    \
                } else {                                                                             \
                    previous = 0;                                                                    \
                    if (s == 2 && tokens) {                                                          \
                        int64_t k = last + 1;                                                        \
                        if (k != into) { /* a new observation (the one before turn k) */             \
                            if (into >= 0 && into < n) STORE(into);                                  \
                            into = k;                                                                \
                            a = b = c = m = 0;                                                       \
                            if (k >= 0 && k < n) LOAD(k);                                            \
                        }                                                                            \
                        uint64_t x = (uint64_t)tokens[base + t] + 1;                                 \
                        a = a * B1 + x;                                                              \
                        b = (b ^ x) * FNV;                                                           \
                        if (h3) { c = c * B3 + (x ^ MIX); m++; }                                     \
                    }                                                                                \
                }                                                                                    \
            }                                                                                        \
            if (current >= 0 && current < n) rr[current] += sum;                                     \
            if (tokens && into >= 0 && into < n) STORE(into);                                        \
            if (carry) { /* the observation before the turn after the row's last, read so far */     \
                const int keep = into == last + 1;                                                   \
                uint64_t *out = carry + 4 * row;                                                     \
                out[0] = keep ? a : 0; out[1] = keep ? b : 0; out[2] = keep ? c : 0; out[3] = keep ? m : 0; \
            }                                                                                        \
            count[row] = top + 1;                                                                    \
        }                                                                                            \
    }

/* out_a (and out_b when given): the tables' value at each ASSISTANT token's turn, 0 elsewhere */
#define BROADCAST(NAME, T)                                                                           \
    void NAME(const double *table_a, const double *table_b, const int8_t *spans, const void *turn_ids, \
              int turn_kind, int64_t rows, int64_t cols, int64_t n, T *out_a, T *out_b) {            \
        for (int64_t row = 0; row < rows; row++) {                                                   \
            const int64_t base = row * cols;                                                         \
            int64_t last = -1, current = -2;                                                         \
            T va = 0, vb = 0;                                                                        \
            int previous = 0;                                                                        \
            for (int64_t t = 0; t < cols; t++) {                                                     \
                if (spans[base + t] == 1) {                                                          \
                    int64_t k = turn_kind ? turn_at(turn_ids, turn_kind, base + t) : (previous ? last : last + 1); \
                    if (k != current) {                                                              \
                        int ok = k >= 0 && k < n;                                                    \
                        va = ok ? (T)table_a[row * n + k] : 0;                                       \
                        if (out_b) vb = ok ? (T)table_b[row * n + k] : 0;                            \
                        current = k;                                                                 \
                    }                                                                                \
                    out_a[base + t] = va;                                                            \
                    if (out_b) out_b[base + t] = vb;                                                 \
                    last = k;                                                                        \
                    previous = 1;                                                                    \
                } else {                                                                             \
                    out_a[base + t] = 0;                                                             \
                    if (out_b) out_b[base + t] = 0;                                                  \
                    previous = 0;                                                                    \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
    }

TABLES(turn_tables_f32, float)
TABLES(turn_tables_f64, double)
BROADCAST(turn_broadcast_f32, float)
BROADCAST(turn_broadcast_f64, double)

/* The first ASSISTANT token whose turn id is neither the largest id before it nor one more, or
 * OBSERVATION token whose id is not that largest id (-1 before any): its flat index, else -1
 * (advantages.turn_credit._check_turn_ids, which names it). */
int64_t check_turn_ids(const int8_t *spans, const void *turn_ids, int turn_kind, int64_t rows, int64_t cols) {
    for (int64_t row = 0; row < rows; row++) {
        int64_t top = -1;
        for (int64_t t = 0; t < cols; t++) {
            const int64_t i = row * cols + t;
            const int8_t s = spans[i];
            if (s == 0) continue;
            const int64_t k = turn_at(turn_ids, turn_kind, i);
            if (s == 1) {
                if (k != top && k != top + 1) return i;
                top = k;
            } else if (s == 2 && k != top) {
                return i;
            }
        }
    }
    return -1;
}
