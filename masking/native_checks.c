/* validate_batch's checks in one pass over a batch's rewards, mask and spans (masking/native_checks.py).
 *
 * One function per (rewards, mask) element type: check_<rewards>_<mask>. Row-major (rows, cols)
 * arrays, cols >= 1; spans are SpanKind bytes (PAD 0, ASSISTANT 1, OBSERVATION 2; an int8 -1 reads
 * as 255), or NULL for a mask-only batch, where every 0 of the mask is an OBSERVATION. Returns 1
 * when any check fails (the caller then runs the single checks for the message) and writes the
 * number of ASSISTANT tokens to *count.
 *
 * A token is bad when its span is unknown, a PAD comes before a non-PAD (`next` is the next span,
 * 0 after a row's last token), the mask is not (span == ASSISTANT) (without spans: not 0/1), or
 * the reward is not 0 off ASSISTANT; `r * (1 - m) != 0` also catches NaN and inf anywhere (NaN * 0
 * and inf * 0 are NaN; a mask that is not 0/1 fails its own check). Compile without -ffast-math:
 * NaN must compare unequal.
 *
 * Speed: failures are or-ed without branches and counts are per-row int32 (the token macros keep
 * their flags in int32, which is what lets every (rewards, mask) pair vectorise). */
#include <stdint.h>

/* The loops are compiled for AVX-512, AVX2 and plain x86-64 (native_simd.h), so the wider vectors
 * are used where the CPU has them (timings: BENCHMARKS.md, issue 20). */
#include "native_simd.h"

#define CHECK_SPANS_TOKEN(R, M, r, m, s, next, bad, count)                                          \
    do {                                                                                            \
        int32_t on_ = (s) == 1;                                                                     \
        (bad) |= ((s) > 2) | (((s) == 0) & ((next) != 0)) | ((m) != (M)on_) | ((r) * (R)(1 - (m)) != 0); \
        (count) += on_;                                                                             \
    } while (0)
#define CHECK_MASK_TOKEN(R, M, r, m, bad, count)                                                    \
    do {                                                                                            \
        int32_t on_ = (m) == 1;                                                                     \
        (bad) |= (!on_ & ((m) != 0)) | ((r) * (R)(1 - (m)) != 0);                                   \
        (count) += on_;                                                                             \
    } while (0)

#define CHECK(NAME, R, M)                                                                             \
    VECTOR_CLONES int NAME(const R *restrict rewards, const M *restrict mask, const uint8_t *restrict spans, \
                           int64_t rows, int64_t cols, int64_t *count) {                              \
        int64_t n = 0;                                                                                \
        int32_t bad = 0;                                                                              \
        for (int64_t i = 0; i < rows; i++) {                                                          \
            const R *r = rewards + i * cols;                                                          \
            const M *m = mask + i * cols;                                                             \
            int32_t row_count = 0, row_bad = 0;                                                       \
            if (spans) {                                                                              \
                const uint8_t *s = spans + i * cols;                                                  \
                for (int64_t j = 0; j + 1 < cols; j++)                                                \
                    CHECK_SPANS_TOKEN(R, M, r[j], m[j], s[j], s[j + 1], row_bad, row_count);          \
                CHECK_SPANS_TOKEN(R, M, r[cols - 1], m[cols - 1], s[cols - 1], 0, row_bad, row_count); \
            } else {                                                                                  \
                for (int64_t j = 0; j < cols; j++) CHECK_MASK_TOKEN(R, M, r[j], m[j], row_bad, row_count); \
            }                                                                                         \
            n += row_count;                                                                           \
            bad |= row_bad;                                                                           \
        }                                                                                             \
        *count = n;                                                                                   \
        return bad != 0;                                                                              \
    }

#define FOR_MASKS(R, RN)                \
    CHECK(check_##RN##_f32, R, float)   \
    CHECK(check_##RN##_f64, R, double)  \
    CHECK(check_##RN##_u8, R, uint8_t)  \
    CHECK(check_##RN##_i8, R, int8_t)   \
    CHECK(check_##RN##_i32, R, int32_t) \
    CHECK(check_##RN##_i64, R, int64_t)

FOR_MASKS(float, f32)
FOR_MASKS(double, f64)
