/* Multi-threaded CPU matvec for a few activation rows: y[M, N] = x[M, K] @ W[N, K]^T, M = 1..8.
 *
 * Why: MLX's CPU backend sends every f32 matmul through cblas_sgemm, M = 1 included, and
 * OpenBLAS 0.3.21's sgemm does not switch to gemv there (5-7 GB/s of weights on a 2-core x86);
 * bf16 and quantized matmuls use MLX's own single-threaded kernels. Decode reads each weight once
 * per token, so it is bound by how fast the weight bytes stream: this module streams them on
 * every usable core with AVX2+FMA (chosen at run time) or a portable scalar loop.
 *
 * Weight formats (all rows contiguous, row n at W + n * row_bytes):
 *   f32     float32 [N, K]
 *   bf16    bfloat16 bits, uint16 [N, K]
 *   affine  MLX affine quantization, group 32: packed uint32 [N, K * bits / 32] (element j of a
 *           row at bits (j % per_word) * bits of word j / per_word, low bits first), scales and
 *           biases float32 [N, K / 32]; w = scale * q + bias. bits = 4 or 8. Q4_0 / Q8_0 GGUF
 *           weights load into exactly this form on the CPU (gemma4_mlx.quants).
 * x and y are float32, every sum is accumulated in float32.
 *
 * Python API (module gemma4_mlx._cpu_matvec; arguments are C-contiguous buffer objects):
 *   matmul_f32(x, w, out, threads)                      x [M, K] f32, w [N, K] f32, out [M, N] f32
 *   matmul_bf16(x, w, out, threads)                     w [N, K] uint16 (or MLX bfloat16)
 *   matmul_affine(x, w, scales, biases, out, bits, threads)
 *   simd() -> str / set_simd("auto" | "scalar")         the inner loops in use / force the scalar ones
 *   sgemm_hook(next_address, threads, on) -> address    a cblas_sgemm for libmlx's GOT (see below;
 *   sgemm_hook_state([on]) -> (address, on, calls)      installed by cpu_matvec.install_sgemm_hook)
 *   min_bytes_per_thread() -> int
 * threads <= 0 means 1. The GIL is released while the worker threads run.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if !defined(_WIN32)
#include <pthread.h>
#define MATVEC_PTHREADS 1
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MATVEC_X86 1
#endif

#define MAX_ROWS 8
#define MAX_THREADS 256
#define GROUP 32
/* The sgemm hook splits a matrix over threads only from this many weight bytes per thread on:
 * starting a thread costs ~10-50 us on an idle core and milliseconds when the other cores are
 * busy (a shared 2-core machine: the layers' 4-8 MB matvecs ran 7x slower on 2 threads than on
 * 1 there), while one core streams ~10-25 GB/s. */
#define MIN_BYTES_PER_THREAD (16LL << 20)

enum { KIND_F32 = 0, KIND_BF16 = 1, KIND_Q4 = 2, KIND_Q8 = 3 };

static int g_avx2 = 0; /* AVX2+FMA inner loops: set at import from the CPU's features */

typedef struct {
    int kind;
    int M;
    int64_t K, N;
    const float *x;       /* [M, K], row m at x + m * x_stride */
    int64_t x_stride, y_stride;
    const float *xsum;    /* [M, K / 32]: per-group sums of x (affine kinds only) */
    const void *w;        /* rows of the weight */
    int64_t row_bytes;
    const float *scales;  /* [N, K / 32] (affine) */
    const float *biases;
    float *y;             /* [M, N], row m at y + m * y_stride */
    int64_t chunk;        /* weight rows a worker takes at a time */
    int64_t next;         /* next unclaimed row (atomic) */
    int avx2;
} Job;

/* y [M, N] (row stride y_stride) = x [M, K] (row stride x_stride) @ W.T, W's rows row_bytes apart;
   the affine kinds also set xsum, scales and biases. */
static Job make_job(int kind, int M, int64_t K, int64_t N, const float *x, int64_t x_stride, const void *w,
                    int64_t row_bytes, float *y, int64_t y_stride) {
    Job job;
    memset(&job, 0, sizeof job);
    job.kind = kind;
    job.M = M;
    job.K = K;
    job.N = N;
    job.x = x;
    job.x_stride = x_stride;
    job.w = w;
    job.row_bytes = row_bytes;
    job.y = y;
    job.y_stride = y_stride;
    job.avx2 = g_avx2;
    return job;
}

/* ------------------------------------------------------------------------------------------ */
/* portable scalar path */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void rows_scalar(const Job *job, int64_t n0, int64_t n1) {
    const int M = job->M;
    const int64_t K = job->K;
    for (int64_t n = n0; n < n1; n++) {
        const unsigned char *row = (const unsigned char *)job->w + n * job->row_bytes;
        float acc[MAX_ROWS] = {0};
        if (job->kind == KIND_F32 || job->kind == KIND_BF16) {
            for (int64_t k = 0; k < K; k++) {
                float wk;
                if (job->kind == KIND_F32) {
                    memcpy(&wk, row + 4 * k, 4);
                } else {
                    uint16_t h;
                    memcpy(&h, row + 2 * k, 2);
                    wk = bf16_to_f32(h);
                }
                for (int m = 0; m < M; m++) acc[m] += wk * job->x[m * job->x_stride + k];
            }
        } else {
            const int bits = job->kind == KIND_Q4 ? 4 : 8;
            const int per_word = 32 / bits;
            const uint32_t mask = (1u << bits) - 1u;
            const int64_t groups = K / GROUP;
            for (int64_t g = 0; g < groups; g++) {
                const float s = job->scales[n * groups + g], b = job->biases[n * groups + g];
                float dot[MAX_ROWS] = {0};
                for (int j = 0; j < GROUP; j++) {
                    const int64_t k = g * GROUP + j;
                    uint32_t word;
                    memcpy(&word, row + 4 * (k / per_word), 4);
                    const float q = (float)((word >> ((k % per_word) * bits)) & mask);
                    for (int m = 0; m < M; m++) dot[m] += q * job->x[m * job->x_stride + k];
                }
                for (int m = 0; m < M; m++) acc[m] += s * dot[m] + b * job->xsum[m * groups + g];
            }
        }
        for (int m = 0; m < M; m++) job->y[m * job->y_stride + n] = acc[m];
    }
}

/* ------------------------------------------------------------------------------------------ */
/* AVX2 + FMA path: one weight row against all M activation rows per pass, sums in registers. */

#ifdef MATVEC_X86
#define AVX2 __attribute__((target("avx2,fma")))
#define INLINE static inline __attribute__((always_inline))

INLINE AVX2 float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE AVX2 __m256 load8_w(int kind, const unsigned char *row, int64_t k) {
    if (kind == KIND_F32) return _mm256_loadu_ps((const float *)row + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Float weights (f32 / bf16): one weight row n against the M activation rows, U independent
 * sums per activation row (k unrolled U x 8). One row at a time keeps the weight read a single
 * sequential stream: on a 2-core EPYC interleaving 2-4 rows read 1.5-2x slower out of DRAM. */
INLINE AVX2 void row_float(const Job *job, int kind, int M, int U, int64_t n) {
    const int64_t K = job->K;
    const unsigned char *row = (const unsigned char *)job->w + n * job->row_bytes;
    __m256 acc[4][MAX_ROWS];
    for (int u = 0; u < U; u++)
        for (int m = 0; m < M; m++) acc[u][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * U <= K; k += 8 * U) {
        for (int u = 0; u < U; u++) {
            const __m256 wv = load8_w(kind, row, k + 8 * u);
            for (int m = 0; m < M; m++)
                acc[u][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(job->x + m * job->x_stride + k + 8 * u), acc[u][m]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        const __m256 wv = load8_w(kind, row, k);
        for (int m = 0; m < M; m++) acc[0][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(job->x + m * job->x_stride + k), acc[0][m]);
    }
    for (int m = 0; m < M; m++) {
        for (int u = 1; u < U; u++) acc[0][m] = _mm256_add_ps(acc[0][m], acc[u][m]);
        float s = hsum8(acc[0][m]);
        for (int64_t t = k; t < K; t++) {
            const float wk = kind == KIND_F32 ? ((const float *)row)[t] : bf16_to_f32(((const uint16_t *)row)[t]);
            s += wk * job->x[m * job->x_stride + t];
        }
        job->y[m * job->y_stride + n] = s;
    }
}

/* The 32 quantized values of one group as 4 x 8 floats. */
INLINE AVX2 void unpack_group(int kind, const unsigned char *row, int64_t g, __m256 q[4]) {
    if (kind == KIND_Q4) {
        const uint32_t *words = (const uint32_t *)row + g * 4;
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        const __m256i mask = _mm256_set1_epi32(0xF);
        for (int i = 0; i < 4; i++) {
            __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32((int)words[i]), shifts);
            q[i] = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
        }
    } else {
        const unsigned char *bytes = row + g * GROUP;
        for (int i = 0; i < 4; i++) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(bytes + 8 * i));
            q[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
        }
    }
}

/* Affine weights: one weight row n; per group, sum_j q_j x_j in 8 lanes, times the scale, plus
 * bias * sum(x over the group). */
INLINE AVX2 void row_affine(const Job *job, int kind, int M, int64_t n) {
    const int64_t K = job->K, groups = K / GROUP;
    const unsigned char *row = (const unsigned char *)job->w + n * job->row_bytes;
    const float *scales = job->scales + n * groups, *biases = job->biases + n * groups;
    __m256 acc[MAX_ROWS];
    float bias_acc[MAX_ROWS];
    for (int m = 0; m < M; m++) {
        acc[m] = _mm256_setzero_ps();
        bias_acc[m] = 0.0f;
    }
    for (int64_t g = 0; g < groups; g++) {
        __m256 q[4];
        unpack_group(kind, row, g, q);
        const __m256 sv = _mm256_set1_ps(scales[g]);
        const float b = biases[g];
        for (int m = 0; m < M; m++) {
            const float *xg = job->x + m * job->x_stride + g * GROUP;
            __m256 d = _mm256_mul_ps(q[0], _mm256_loadu_ps(xg));
            d = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xg + 8), d);
            d = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xg + 16), d);
            d = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xg + 24), d);
            acc[m] = _mm256_fmadd_ps(sv, d, acc[m]);
            bias_acc[m] += b * job->xsum[m * groups + g];
        }
    }
    for (int m = 0; m < M; m++) job->y[m * job->y_stride + n] = hsum8(acc[m]) + bias_acc[m];
}

/* Rows n0..n1 with M a compile-time constant in each expansion (the loops above unroll). */
#define FLOAT_CASE(KIND, MM, UU)                                              \
    case MM:                                                                  \
        for (int64_t n = n0; n < n1; n++) row_float(job, KIND, MM, UU, n);    \
        break;
#define AFFINE_CASE(KIND, MM)                                                 \
    case MM:                                                                  \
        for (int64_t n = n0; n < n1; n++) row_affine(job, KIND, MM, n);       \
        break;
#define FLOAT_SWITCH(KIND)                                                    \
    switch (job->M) {                                                         \
        FLOAT_CASE(KIND, 1, 4)                                                \
        FLOAT_CASE(KIND, 2, 2)                                                \
        FLOAT_CASE(KIND, 3, 2)                                                \
        FLOAT_CASE(KIND, 4, 1)                                                \
        FLOAT_CASE(KIND, 5, 1)                                                \
        FLOAT_CASE(KIND, 6, 1)                                                \
        FLOAT_CASE(KIND, 7, 1)                                                \
        FLOAT_CASE(KIND, 8, 1)                                                \
    }
#define AFFINE_SWITCH(KIND)                                                   \
    switch (job->M) {                                                         \
        AFFINE_CASE(KIND, 1)                                                  \
        AFFINE_CASE(KIND, 2)                                                  \
        AFFINE_CASE(KIND, 3)                                                  \
        AFFINE_CASE(KIND, 4)                                                  \
        AFFINE_CASE(KIND, 5)                                                  \
        AFFINE_CASE(KIND, 6)                                                  \
        AFFINE_CASE(KIND, 7)                                                  \
        AFFINE_CASE(KIND, 8)                                                  \
    }

static AVX2 void rows_f32_avx2(const Job *job, int64_t n0, int64_t n1) { FLOAT_SWITCH(KIND_F32) }
static AVX2 void rows_bf16_avx2(const Job *job, int64_t n0, int64_t n1) { FLOAT_SWITCH(KIND_BF16) }
static AVX2 void rows_q4_avx2(const Job *job, int64_t n0, int64_t n1) { AFFINE_SWITCH(KIND_Q4) }
static AVX2 void rows_q8_avx2(const Job *job, int64_t n0, int64_t n1) { AFFINE_SWITCH(KIND_Q8) }

static int cpu_has_avx2_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
#else
static int cpu_has_avx2_fma(void) { return 0; }
#endif

static void run_rows(const Job *job, int64_t n0, int64_t n1) {
#ifdef MATVEC_X86
    if (job->avx2) {
        switch (job->kind) {
            case KIND_F32: rows_f32_avx2(job, n0, n1); return;
            case KIND_BF16: rows_bf16_avx2(job, n0, n1); return;
            case KIND_Q4: rows_q4_avx2(job, n0, n1); return;
            case KIND_Q8: rows_q8_avx2(job, n0, n1); return;
        }
    }
#endif
    rows_scalar(job, n0, n1);
}

/* ------------------------------------------------------------------------------------------ */
/* threads: each worker claims `chunk` rows at a time until none are left (dynamic balance) */

static int64_t claim(Job *job) {
#if defined(__GNUC__) || defined(__clang__)
    return __atomic_fetch_add(&job->next, job->chunk, __ATOMIC_RELAXED);
#else
    int64_t n = job->next;
    job->next += job->chunk;
    return n;
#endif
}

static void *worker(void *arg) {
    Job *job = (Job *)arg;
    for (;;) {
        const int64_t n0 = claim(job);
        if (n0 >= job->N) break;
        const int64_t n1 = n0 + job->chunk < job->N ? n0 + job->chunk : job->N;
        run_rows(job, n0, n1);
    }
    return NULL;
}

static void run_job(Job *job, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    /* ~8 chunks per thread for balance on a loaded machine, at least 64 rows each */
    int64_t chunk = job->N / ((int64_t)threads * 8);
    chunk = (chunk + 3) / 4 * 4;
    if (chunk < 64) chunk = 64;
    job->chunk = chunk;
    job->next = 0;
    if ((job->N + chunk - 1) / chunk < threads) threads = (int)((job->N + chunk - 1) / chunk);
#ifdef MATVEC_PTHREADS
    pthread_t ids[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[started], NULL, worker, job) != 0) break; /* fewer threads is fine */
        started++;
    }
    worker(job);
    for (int t = 0; t < started; t++) pthread_join(ids[t], NULL);
#else
    (void)threads;
    worker(job);
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* cblas_sgemm hook: MLX's CPU backend calls cblas_sgemm for every f32 matmul (M = 1 included)
 * through its GOT; cpu_matvec.install_sgemm_hook() points that slot here. Calls of the shape
 * y = x @ W.T with 1..8 rows (row-major, A not transposed, B transposed, alpha 1, beta 0) run
 * through the matvec above; every other call goes on to the BLAS the slot held before. */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
static sgemm_fn g_sgemm_next = NULL;
static int g_sgemm_threads = 1;
static int g_sgemm_on = 0;
static int64_t g_sgemm_hits = 0;

enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

static void sgemm_hook(int order, int trans_a, int trans_b, int M, int N, int K, float alpha, const float *A,
                       int lda, const float *B, int ldb, float beta, float *C, int ldc) {
    if (g_sgemm_on && order == CBLAS_ROW_MAJOR && trans_a == CBLAS_NO_TRANS && trans_b == CBLAS_TRANS && M >= 1 &&
        M <= MAX_ROWS && N >= 1 && K >= 1 && alpha == 1.0f && beta == 0.0f && lda >= K && ldb >= K && ldc >= N) {
        Job job = make_job(KIND_F32, M, K, N, A, lda, B, (int64_t)ldb * 4, C, ldc);
        const int64_t by_size = (int64_t)N * K * 4 / MIN_BYTES_PER_THREAD;
        run_job(&job, by_size < 1 ? 1 : by_size < g_sgemm_threads ? (int)by_size : g_sgemm_threads);
#if defined(__GNUC__) || defined(__clang__)
        __atomic_fetch_add(&g_sgemm_hits, 1, __ATOMIC_RELAXED);
#endif
        return;
    }
    g_sgemm_next(order, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

static PyObject *py_sgemm_hook(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long next;
    int threads, on;
    if (!PyArg_ParseTuple(args, "Kii", &next, &threads, &on)) return NULL;
    if (next == 0 || next == (unsigned long long)(uintptr_t)&sgemm_hook) {
        PyErr_SetString(PyExc_ValueError, "the BLAS to forward to must be another cblas_sgemm");
        return NULL;
    }
    g_sgemm_next = (sgemm_fn)(uintptr_t)next;
    g_sgemm_threads = threads < 1 ? 1 : threads;
    g_sgemm_on = on != 0;
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)&sgemm_hook);
}

static PyObject *py_sgemm_hook_state(PyObject *self, PyObject *args) {
    (void)self;
    int on = -1;
    if (!PyArg_ParseTuple(args, "|i", &on)) return NULL;
    if (on >= 0) g_sgemm_on = on != 0 && g_sgemm_next != NULL;
    return Py_BuildValue("(KiL)", (unsigned long long)(uintptr_t)&sgemm_hook, g_sgemm_on, (long long)g_sgemm_hits);
}

/* ------------------------------------------------------------------------------------------ */
/* argument checks */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static void release(Buf *b) {
    if (b->held) PyBuffer_Release(&b->view);
    b->held = 0;
}

/* The format's type letter without a native byte-order prefix ('<f' -> 'f'); MLX bf16 says
 * "bfloat16". Big-endian prefixes are kept, so such buffers fail every type check below. */
static const char *base_format(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    const uint16_t probe = 1;
    const int little = *(const uint8_t *)&probe == 1;
    while (*f == '=' || *f == '@' || (little && *f == '<') || (!little && (*f == '>' || *f == '!'))) f++;
    return f;
}

static int is_f32(const Py_buffer *v) { return v->itemsize == 4 && strcmp(base_format(v), "f") == 0; }
static int is_u16(const Py_buffer *v) {
    const char *f = base_format(v);
    return v->itemsize == 2 && (strcmp(f, "H") == 0 || strcmp(f, "bfloat16") == 0);
}
static int is_u32(const Py_buffer *v) {
    const char *f = base_format(v);
    return v->itemsize == 4 && (strcmp(f, "I") == 0 || strcmp(f, "L") == 0);
}

/* A C-contiguous 2-D buffer; writable if asked. Sets a ValueError naming `what` on failure.
 * Contiguity is checked here from the exported strides and length, not left to the exporter: some
 * (MLX arrays) ignore PyBUF_C_CONTIGUOUS and export transposed or broadcast views as they are. */
static int get2d(PyObject *obj, Buf *b, int writable, const char *what) {
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &b->view, flags) != 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous%s buffer (a numpy array or a memoryview)",
                     what, writable ? ", writable" : "");
        return -1;
    }
    b->held = 1;
    if (b->view.ndim != 2) {
        PyErr_Format(PyExc_ValueError, "%s must be 2-D, got %d dimension(s)", what, b->view.ndim);
        return -1;
    }
    const Py_ssize_t item = b->view.itemsize, rows = b->view.shape[0], cols = b->view.shape[1];
    const int contiguous = b->view.strides == NULL ||
        ((cols <= 1 || b->view.strides[1] == item) && (rows <= 1 || b->view.strides[0] == cols * item));
    if (!contiguous || item < 1 || rows < 0 || cols < 0 || b->view.len != rows * cols * item) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous buffer (got strides or a length that are "
                     "not those of a dense (%zd, %zd) array)", what, rows, cols);
        return -1;
    }
    return 0;
}

#define DIM(b, i) ((int64_t)(b).view.shape[i])

static int check_x_out(const Buf *x, const Buf *out, int64_t N) {
    if (!is_f32(&x->view)) {
        PyErr_Format(PyExc_ValueError, "x must be float32, got format '%s'", base_format(&x->view));
        return -1;
    }
    if (!is_f32(&out->view)) {
        PyErr_Format(PyExc_ValueError, "out must be float32, got format '%s'", base_format(&out->view));
        return -1;
    }
    const int64_t M = DIM(*x, 0);
    if (M < 1 || M > MAX_ROWS) {
        PyErr_Format(PyExc_ValueError, "x must have 1..%d rows, got %lld", MAX_ROWS, (long long)M);
        return -1;
    }
    if (DIM(*x, 1) < 1) {
        PyErr_SetString(PyExc_ValueError, "x must have at least one column");
        return -1;
    }
    if (DIM(*out, 0) != M || DIM(*out, 1) != N) {
        PyErr_Format(PyExc_ValueError, "out must have shape (%lld, %lld), got (%lld, %lld)", (long long)M,
                     (long long)N, (long long)DIM(*out, 0), (long long)DIM(*out, 1));
        return -1;
    }
    if (N < 1) {
        PyErr_SetString(PyExc_ValueError, "the weight must have at least one row");
        return -1;
    }
    return 0;
}

static PyObject *float_matmul(PyObject *args, int kind) {
    PyObject *xo, *wo, *oo;
    int threads;
    if (!PyArg_ParseTuple(args, "OOOi", &xo, &wo, &oo, &threads)) return NULL;
    Buf x = {0}, w = {0}, out = {0};
    PyObject *result = NULL;
    if (get2d(xo, &x, 0, "x") || get2d(wo, &w, 0, "w") || get2d(oo, &out, 1, "out")) goto done;
    if (kind == KIND_F32 ? !is_f32(&w.view) : !is_u16(&w.view)) {
        PyErr_Format(PyExc_ValueError, "w must be %s, got format '%s'",
                     kind == KIND_F32 ? "float32" : "bfloat16 bits (uint16)", base_format(&w.view));
        goto done;
    }
    if (check_x_out(&x, &out, DIM(w, 0))) goto done;
    if (DIM(w, 1) != DIM(x, 1)) {
        PyErr_Format(PyExc_ValueError, "x has %lld columns but w has %lld (w is [N, K], x is [M, K])",
                     (long long)DIM(x, 1), (long long)DIM(w, 1));
        goto done;
    }
    const int64_t K = DIM(x, 1), N = DIM(w, 0);
    Job job = make_job(kind, (int)DIM(x, 0), K, N, (const float *)x.view.buf, K, w.view.buf,
                       K * (kind == KIND_F32 ? 4 : 2), (float *)out.view.buf, N);
    Py_BEGIN_ALLOW_THREADS
    run_job(&job, threads);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    release(&x);
    release(&w);
    release(&out);
    return result;
}

static PyObject *py_matmul_f32(PyObject *self, PyObject *args) {
    (void)self;
    return float_matmul(args, KIND_F32);
}

static PyObject *py_matmul_bf16(PyObject *self, PyObject *args) {
    (void)self;
    return float_matmul(args, KIND_BF16);
}

static PyObject *py_matmul_affine(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *wo, *so, *bo, *oo;
    int bits, threads;
    if (!PyArg_ParseTuple(args, "OOOOOii", &xo, &wo, &so, &bo, &oo, &bits, &threads)) return NULL;
    Buf x = {0}, w = {0}, sc = {0}, bi = {0}, out = {0};
    PyObject *result = NULL;
    float *xsum = NULL;
    if (bits != 4 && bits != 8) {
        PyErr_Format(PyExc_ValueError, "bits must be 4 or 8, got %d", bits);
        return NULL;
    }
    if (get2d(xo, &x, 0, "x") || get2d(wo, &w, 0, "w") || get2d(so, &sc, 0, "scales") ||
        get2d(bo, &bi, 0, "biases") || get2d(oo, &out, 1, "out"))
        goto done;
    if (!is_u32(&w.view)) {
        PyErr_Format(PyExc_ValueError, "w must be packed uint32, got format '%s'", base_format(&w.view));
        goto done;
    }
    if (!is_f32(&sc.view) || !is_f32(&bi.view)) {
        PyErr_SetString(PyExc_ValueError, "scales and biases must be float32");
        goto done;
    }
    const int64_t N = DIM(w, 0), K = DIM(x, 1);
    if (check_x_out(&x, &out, N)) goto done;
    if (K % GROUP != 0) {
        PyErr_Format(PyExc_ValueError, "x has %lld columns, not a multiple of the group size %d", (long long)K,
                     GROUP);
        goto done;
    }
    if (DIM(w, 1) * (32 / bits) != K) {
        PyErr_Format(PyExc_ValueError, "w has %lld uint32 words per row, %d-bit rows of %lld values need %lld",
                     (long long)DIM(w, 1), bits, (long long)K, (long long)(K * bits / 32));
        goto done;
    }
    if (DIM(sc, 0) != N || DIM(sc, 1) != K / GROUP || DIM(bi, 0) != N || DIM(bi, 1) != K / GROUP) {
        PyErr_Format(PyExc_ValueError, "scales and biases must have shape (%lld, %lld)", (long long)N,
                     (long long)(K / GROUP));
        goto done;
    }
    const int M = (int)DIM(x, 0);
    const int64_t groups = K / GROUP;
    xsum = (float *)PyMem_Malloc(sizeof(float) * (size_t)(M * groups));
    if (!xsum) {
        PyErr_NoMemory();
        goto done;
    }
    const float *xp = (const float *)x.view.buf;
    for (int m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int j = 0; j < GROUP; j++) s += xp[m * K + g * GROUP + j];
            xsum[m * groups + g] = s;
        }
    Job job = make_job(bits == 4 ? KIND_Q4 : KIND_Q8, M, K, N, xp, K, w.view.buf, K * bits / 8,
                       (float *)out.view.buf, N);
    job.xsum = xsum;
    job.scales = (const float *)sc.view.buf;
    job.biases = (const float *)bi.view.buf;
    Py_BEGIN_ALLOW_THREADS
    run_job(&job, threads);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(xsum);
    release(&x);
    release(&w);
    release(&sc);
    release(&bi);
    release(&out);
    return result;
}

static PyObject *py_min_bytes(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyLong_FromLongLong(MIN_BYTES_PER_THREAD);
}

static PyObject *py_simd(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(g_avx2 ? "avx2+fma" : "scalar");
}

static PyObject *py_set_simd(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    if (strcmp(name, "scalar") == 0) {
        g_avx2 = 0;
    } else if (strcmp(name, "auto") == 0) {
        g_avx2 = cpu_has_avx2_fma();
    } else {
        PyErr_Format(PyExc_ValueError, "simd must be 'auto' or 'scalar', got '%s'", name);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"matmul_f32", py_matmul_f32, METH_VARARGS,
     "matmul_f32(x, w, out, threads): out[M, N] = x[M, K] @ w[N, K].T, all float32, M = 1..8"},
    {"matmul_bf16", py_matmul_bf16, METH_VARARGS,
     "matmul_bf16(x, w, out, threads): w holds bfloat16 bits (uint16 [N, K]); x, out float32"},
    {"matmul_affine", py_matmul_affine, METH_VARARGS,
     "matmul_affine(x, w, scales, biases, out, bits, threads): w packed uint32 [N, K*bits/32], "
     "scales/biases float32 [N, K/32] (MLX affine, group 32); x, out float32"},
    {"sgemm_hook", py_sgemm_hook, METH_VARARGS,
     "sgemm_hook(next_address, threads, on) -> hook address: set the cblas_sgemm that non-matvec calls "
     "go to (the caller then writes the returned address into libmlx's GOT slot)"},
    {"sgemm_hook_state", py_sgemm_hook_state, METH_VARARGS,
     "sgemm_hook_state([on]) -> (hook address, on, calls served): switch the matvec path of the hook"},
    {"min_bytes_per_thread", py_min_bytes, METH_NOARGS,
     "min_bytes_per_thread() -> int: weight bytes per thread below which the hook uses fewer threads"},
    {"simd", py_simd, METH_NOARGS, "simd() -> 'avx2+fma' or 'scalar': the inner loops in use"},
    {"set_simd", py_set_simd, METH_VARARGS, "set_simd('auto' | 'scalar'): pick the inner loops (tests)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cpu_matvec",
    "Multi-threaded CPU matvec y = x @ W.T for 1..8 rows (f32, bf16, MLX affine 4/8-bit weights).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cpu_matvec(void) {
    g_avx2 = cpu_has_avx2_fma();
    return PyModule_Create(&module);
}
