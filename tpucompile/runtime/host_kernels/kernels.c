/* Matrix products of XLA CPU programs, run by the host's BLAS (the one torch links: MKL or OpenBLAS).
 *
 * One XLA FFI handler, `tpucompile_host_gemm`, computes out[b] = op(lhs[b]) @ op(rhs[b]) for every b of a
 * leading batch dimension, on row-major buffers:
 *   lhs [B, M, K], or [B, K, M] with attribute transpose_lhs = 1
 *   rhs [B, K, N], or [B, N, K] with attribute transpose_rhs = 1
 *   out [B, M, N]
 * for f32 x f32 -> f32, f64 x f64 -> f64 and bf16 x bf16 -> f32. The BLAS entry points are not linked: the
 * Python side looks them up in the already loaded BLAS and hands their addresses to
 * tpucompile_host_blas_bind, so this library depends on nothing but the XLA FFI C API header.
 *
 * Row-major products go to column-major Fortran BLAS as the transposed product: out^T = op(rhs)^T op(lhs)^T,
 * which reads the same memory with the operands swapped, so no data moves.
 */

#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "xla/ffi/api/c_api.h"

typedef void real_gemm_f32(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                           const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                           const float* beta, float* c, const int* ldc);
typedef void real_gemm_f64(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                           const double* alpha, const double* a, const int* lda, const double* b,
                           const int* ldb, const double* beta, double* c, const int* ldc);
/* cblas_gemm_bf16bf16f32 (MKL): CBLAS layout and transpose enums, bf16 operands as uint16_t. */
typedef void bf16_gemm_f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                           const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c,
                           int ldc);

enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

typedef int set_local_threads(int count);

static set_local_threads* blas_threads_local;
static real_gemm_f32* gemm_f32;
static real_gemm_f64* gemm_f64;
static bf16_gemm_f32* gemm_bf16;

/* Addresses of sgemm_, dgemm_ and cblas_gemm_bf16bf16f32 (any may be NULL: that dtype is then refused). */
/* MKL's per-thread thread count setter (MKL_Set_Num_Threads_Local), or NULL for a BLAS without one. */
void tpucompile_host_blas_threads(void* set_local) { blas_threads_local = (set_local_threads*)set_local; }

void tpucompile_host_blas_bind(void* sgemm, void* dgemm, void* bf16_gemm) {
  gemm_f32 = (real_gemm_f32*)sgemm;
  gemm_f64 = (real_gemm_f64*)dgemm;
  gemm_bf16 = (bf16_gemm_f32*)bf16_gemm;
}

/* Compares every bound kernel with a plain loop on small products in all four transpose combinations: a BLAS
 * with another integer width or calling convention shows here, not as wrong results later. Returns the kernels
 * that agree as bits: 1 f32, 2 f64, 4 bf16. */
int tpucompile_host_blas_selftest(void) {
  enum { M = 3, N = 4, K = 5 };
  int f32_ok = gemm_f32 != NULL, f64_ok = gemm_f64 != NULL, bf16_ok = gemm_bf16 != NULL;
  for (int t = 0; t < 4; ++t) {
    int tl = t & 1, tr = t >> 1;
    float lf[M * K], rf[K * N], cf[M * N];
    double ld_[M * K], rd[K * N], cd[M * N];
    for (int i = 0; i < M * K; ++i) lf[i] = (float)(ld_[i] = (double)((i * 7) % 11) - 5.0);
    for (int i = 0; i < K * N; ++i) rf[i] = (float)(rd[i] = (double)((i * 5) % 13) - 6.0);
    int m = M, n = N, k = K, lda = tr ? K : N, ldb = tl ? M : K, ldc = N;
    const char* ta = tr ? "T" : "N";
    const char* tb = tl ? "T" : "N";
    if (gemm_f32 != NULL) {
      const float one = 1.0f, zero = 0.0f;
      gemm_f32(ta, tb, &n, &m, &k, &one, rf, &lda, lf, &ldb, &zero, cf, &ldc);
    }
    if (gemm_f64 != NULL) {
      const double one = 1.0, zero = 0.0;
      gemm_f64(ta, tb, &n, &m, &k, &one, rd, &lda, ld_, &ldb, &zero, cd, &ldc);
    }
    for (int i = 0; i < M; ++i) {
      for (int j = 0; j < N; ++j) {
        double want = 0.0;
        for (int p = 0; p < K; ++p) {
          double a = tl ? ld_[p * M + i] : ld_[i * K + p];
          double b = tr ? rd[j * K + p] : rd[p * N + j];
          want += a * b;
        }
        if (gemm_f32 != NULL) f32_ok &= cf[i * N + j] == (float)want;
        if (gemm_f64 != NULL) f64_ok &= cd[i * N + j] == want;
      }
    }
  }
  if (bf16_ok) {
    /* bf16 of small integers is exact: 0x3F80 is 1.0, 0x4000 is 2.0. */
    uint16_t a[2 * 2] = {0x3F80, 0x4000, 0x4000, 0x3F80}, b[2 * 2] = {0x3F80, 0x3F80, 0x4000, 0x3F80};
    float c[4];
    gemm_bf16(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_NO_TRANS, 2, 2, 2, 1.0f, a, 2, b, 2, 0.0f, c, 2);
    bf16_ok = c[0] == 5.0f && c[1] == 3.0f && c[2] == 4.0f && c[3] == 3.0f;
  }
  return f32_ok | f64_ok << 1 | bf16_ok << 2;
}

static XLA_FFI_Error* error(const XLA_FFI_Api* api, XLA_FFI_Error_Code code, const char* message) {
  XLA_FFI_Error_Create_Args args;
  memset(&args, 0, sizeof args);
  args.struct_size = XLA_FFI_Error_Create_Args_STRUCT_SIZE;
  args.message = message;
  args.errc = code;
  return api->XLA_FFI_Error_Create(&args);
}

/* The integer scalar attribute `name` into `value` (which may be negative: a padding that crops); 0 when it is
 * absent or not an integer. Attributes are few, so a scan is enough. */
static int scalar(const XLA_FFI_CallFrame* frame, const char* name, int64_t* value) {
  size_t length = strlen(name);
  for (int64_t i = 0; i < frame->attrs.size; ++i) {
    const XLA_FFI_ByteSpan* key = frame->attrs.names[i];
    if (key->len != length || memcmp(key->ptr, name, length) != 0) continue;
    if (frame->attrs.types[i] != XLA_FFI_AttrType_SCALAR) return 0;
    const XLA_FFI_Scalar* attr = (const XLA_FFI_Scalar*)frame->attrs.attrs[i];
    if (attr->dtype == XLA_FFI_DataType_S64) *value = *(const int64_t*)attr->value;
    else if (attr->dtype == XLA_FFI_DataType_S32) *value = *(const int32_t*)attr->value;
    else return 0;
    return 1;
  }
  return 0;
}

/* On XLA's pool threads the BLAS runs single-threaded (see tpucompile_host_gemm); set once per thread. */
static void single_blas_thread_on_xla_pool(void) {
  static _Thread_local int thread_checked = 0;
  if (blas_threads_local == NULL || thread_checked) return;
  char name[32] = {0};
  if (pthread_getname_np(pthread_self(), name, sizeof name) == 0 && strncmp(name, "tf_XLA", 6) == 0) {
    blas_threads_local(1);
  }
  thread_checked = 1;
}

static XLA_FFI_Error* describe_handler(XLA_FFI_CallFrame* frame) {
  XLA_FFI_Metadata_Extension* extension = (XLA_FFI_Metadata_Extension*)frame->extension_start;
  if (extension->extension_base.struct_size < XLA_FFI_Metadata_Extension_STRUCT_SIZE ||
      extension->metadata->struct_size < XLA_FFI_Metadata_STRUCT_SIZE) {
    return error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "tpucompile_host_gemm: metadata too small");
  }
  extension->metadata->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
  extension->metadata->api_version.extension_start = NULL;
  extension->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
  extension->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
  extension->metadata->traits = 0;
  extension->metadata->state_type_id.type_id = 0;
  return NULL;
}

static XLA_FFI_Error* multiply(XLA_FFI_CallFrame* frame, const XLA_FFI_Buffer* lhs, const XLA_FFI_Buffer* rhs,
                               const XLA_FFI_Buffer* out, int64_t batch, int m, int n, int k, int64_t transpose_lhs,
                               int64_t transpose_rhs);

XLA_FFI_Error* tpucompile_host_gemm(XLA_FFI_CallFrame* frame) {
  if (frame->struct_size < XLA_FFI_CallFrame_STRUCT_SIZE) {
    return error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "tpucompile_host_gemm: call frame too small");
  }
  if (frame->extension_start != NULL && frame->extension_start->type == XLA_FFI_Extension_Metadata) {
    return describe_handler(frame);
  }
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  if (frame->args.size != 2 || frame->rets.size != 1 || frame->args.types[0] != XLA_FFI_ArgType_BUFFER ||
      frame->args.types[1] != XLA_FFI_ArgType_BUFFER || frame->rets.types[0] != XLA_FFI_RetType_BUFFER) {
    return error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                 "tpucompile_host_gemm: expects two operand buffers and one result buffer");
  }
  const XLA_FFI_Buffer* lhs = (const XLA_FFI_Buffer*)frame->args.args[0];
  const XLA_FFI_Buffer* rhs = (const XLA_FFI_Buffer*)frame->args.args[1];
  const XLA_FFI_Buffer* out = (const XLA_FFI_Buffer*)frame->rets.rets[0];
  int64_t transpose_lhs = -1, transpose_rhs = -1;
  scalar(frame, "transpose_lhs", &transpose_lhs);
  scalar(frame, "transpose_rhs", &transpose_rhs);
  if (lhs->rank != 3 || rhs->rank != 3 || out->rank != 3 || transpose_lhs < 0 || transpose_rhs < 0) {
    return error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT,
                 "tpucompile_host_gemm: expects rank-3 buffers and integer transpose_lhs/transpose_rhs");
  }
  int64_t batch = out->dims[0];
  int m = (int)out->dims[1], n = (int)out->dims[2];
  int k = (int)(transpose_lhs ? lhs->dims[1] : lhs->dims[2]);
  int lhs_rows = (int)(transpose_lhs ? lhs->dims[2] : lhs->dims[1]);
  int rhs_cols = (int)(transpose_rhs ? rhs->dims[1] : rhs->dims[2]);
  int rhs_k = (int)(transpose_rhs ? rhs->dims[2] : rhs->dims[1]);
  if (lhs->dims[0] != batch || rhs->dims[0] != batch || lhs_rows != m || rhs_cols != n || rhs_k != k) {
    return error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT, "tpucompile_host_gemm: operand shapes disagree");
  }
  if (m == 0 || n == 0) return NULL;
  /* The BLAS runs on the calling thread alone, for this call: an OpenMP team forked from inside an XLA program
   * competes with XLA's pool threads (which spin for a while after their own work) for the cores, which can
   * make a product that beats XLA's alone lose inside a whole program. The thread's own setting is restored
   * before returning, so on torch's thread (where programs run inline) the thread count stays as torch and
   * the user set it. */
  int previous_blas_threads = blas_threads_local != NULL ? blas_threads_local(1) : -1;
  XLA_FFI_Error* result = multiply(frame, lhs, rhs, out, batch, m, n, k, transpose_lhs, transpose_rhs);
  if (previous_blas_threads >= 0) blas_threads_local(previous_blas_threads);
  return result;
}

/* out[b] = op(lhs[b]) @ op(rhs[b]) for every b, by the bound BLAS kernel of the buffers' dtypes. */
static XLA_FFI_Error* multiply(XLA_FFI_CallFrame* frame, const XLA_FFI_Buffer* lhs, const XLA_FFI_Buffer* rhs,
                               const XLA_FFI_Buffer* out, int64_t batch, int m, int n, int k, int64_t transpose_lhs,
                               int64_t transpose_rhs) {
  int64_t lhs_step = (int64_t)m * k, rhs_step = (int64_t)k * n, out_step = (int64_t)m * n;
  /* Column-major view: out^T [n, m] = op(rhs)^T [n, k] @ op(lhs)^T [k, m]. */
  const char* trans_a = transpose_rhs ? "T" : "N";
  const char* trans_b = transpose_lhs ? "T" : "N";
  int lda = transpose_rhs ? k : n, ldb = transpose_lhs ? m : k, ldc = n;

  if (lhs->dtype == XLA_FFI_DataType_F32 && rhs->dtype == XLA_FFI_DataType_F32 &&
      out->dtype == XLA_FFI_DataType_F32 && gemm_f32 != NULL) {
    const float one = 1.0f, zero = 0.0f;
    const float *a = (const float*)rhs->data, *b = (const float*)lhs->data;
    float* c = (float*)out->data;
    if (k == 0) {
      memset(c, 0, (size_t)(batch * out_step) * sizeof *c);
      return NULL;
    }
    for (int64_t i = 0; i < batch; ++i) {
      gemm_f32(trans_a, trans_b, &n, &m, &k, &one, a + i * rhs_step, &lda, b + i * lhs_step, &ldb, &zero,
               c + i * out_step, &ldc);
    }
    return NULL;
  }
  if (lhs->dtype == XLA_FFI_DataType_F64 && rhs->dtype == XLA_FFI_DataType_F64 &&
      out->dtype == XLA_FFI_DataType_F64 && gemm_f64 != NULL) {
    const double one = 1.0, zero = 0.0;
    const double *a = (const double*)rhs->data, *b = (const double*)lhs->data;
    double* c = (double*)out->data;
    if (k == 0) {
      memset(c, 0, (size_t)(batch * out_step) * sizeof *c);
      return NULL;
    }
    for (int64_t i = 0; i < batch; ++i) {
      gemm_f64(trans_a, trans_b, &n, &m, &k, &one, a + i * rhs_step, &lda, b + i * lhs_step, &ldb, &zero,
               c + i * out_step, &ldc);
    }
    return NULL;
  }
  if (lhs->dtype == XLA_FFI_DataType_BF16 && rhs->dtype == XLA_FFI_DataType_BF16 &&
      out->dtype == XLA_FFI_DataType_F32 && gemm_bf16 != NULL) {
    const uint16_t *a = (const uint16_t*)lhs->data, *b = (const uint16_t*)rhs->data;
    float* c = (float*)out->data;
    if (k == 0) {
      memset(c, 0, (size_t)(batch * out_step) * sizeof *c);
      return NULL;
    }
    /* Row-major CBLAS: out [m, n] = op(lhs) @ op(rhs) directly. */
    int row_lda = transpose_lhs ? m : k, row_ldb = transpose_rhs ? k : n;
    for (int64_t i = 0; i < batch; ++i) {
      gemm_bf16(CBLAS_ROW_MAJOR, transpose_lhs ? CBLAS_TRANS : CBLAS_NO_TRANS,
                transpose_rhs ? CBLAS_TRANS : CBLAS_NO_TRANS, m, n, k, 1.0f, a + i * lhs_step, row_lda,
                b + i * rhs_step, row_ldb, 0.0f, c + i * out_step, n);
    }
    return NULL;
  }
  return error(frame->api, XLA_FFI_Error_Code_UNIMPLEMENTED,
               "tpucompile_host_gemm: no host BLAS kernel for these dtypes");
}

/* Two-dimensional f32 convolutions as im2col (or col2im) around BLAS products, the way ATen's fallback kernels
 * compute them: XLA's CPU convolutions are slower than that on the small-channel, large-image shapes vision
 * models train with.
 *
 * `tpucompile_host_conv` takes the convolution's two operands and returns (out, scratch); scratch is workspace
 * that XLA allocates with the program's other temporaries (the program never reads it). Buffers are row-major.
 * stride, pad (the low side; the high side follows from the sizes) and rhs_dilation always describe a forward
 * convolution; `mode` says what is computed with it:
 *   0 (forward): lhs = x [B, C, H, W], kernel [O, C, KH, KW] (or [C, O, KH, KW] with kernel_io = 1), out =
 *     y [B, O, OH, OW]: y[b] = kernel @ im2col(x'[b]), where x' is x with lhs_dilation - 1 zeros between
 *     neighbours and zero outside.
 *   1 (kernel gradient): lhs = x [B, C, H, W], rhs = gy [B, O, OH, OW], out = gw [O, C, KH, KW]:
 *     gw = sum over b of gy[b] @ im2col(x[b])^T.
 *   2 (transposed convolution, also the input gradient of a strided convolution): lhs = gy [B, O, H, W],
 *     kernel = the transposed convolution's, i.e. the forward's reversed, [O, C, KH, KW] (kernel_io = 1) or
 *     [C, O, KH, KW], out = gx [B, C, OH, OW]: gx[b] = col2im(forward kernel^T @ gy[b]), with no
 *     multiplications by the zeros a dilated input would hold.
 * Images are processed `group` at a time, side by side in one product: small images make thin products,
 * which the BLAS runs far below its peak. A worker needs, per group, its columns (K x group*P, where K is the
 * rows of im2col and P the positions of one image) and a staging matrix (rows x group*P for the result or the
 * operand that is not laid out side by side), in mode 1 also its partial sum (O x K); the repacked kernel
 * (modes 0 with kernel_io and 2) is shared.
 *
 * Groups are shared out between the calling thread and tasks scheduled on XLA's intra-op pool, as many workers
 * as the scratch holds slots and the pool has threads. A worker claims groups until none is left; the caller
 * waits only for groups others have claimed, so a task that starts late (or never, on a busy pool) costs
 * nothing. The job lives on the heap until its last holder lets go: tasks may start after the call returned. */

typedef struct {
  int64_t C, H, W;        /* the image im2col reads (mode 0/1) or col2im writes (mode 2) is [C, H, W] */
  int64_t KH, KW, OH, OW; /* kernel taps; positions of the other side (y in mode 0/1, gy in mode 2) */
  int64_t stride[2], pad[2], lhs_dilation[2], rhs_dilation[2];
} conv_geometry;

/* cols[(c*KH + i)*KW + j][y*OW + x] (rows `ld` apart) = image'[c][y*stride - pad + i*rhs_dilation][...],
 * where image' is `image` dilated by lhs_dilation and zero outside. */
static void im2col(const conv_geometry* g, const float* image, float* cols, int64_t ld) {
  int64_t dilated_h = (g->H - 1) * g->lhs_dilation[0] + 1, dilated_w = (g->W - 1) * g->lhs_dilation[1] + 1;
  int contiguous = g->stride[1] == 1 && g->lhs_dilation[1] == 1;
  for (int64_t c = 0; c < g->C; ++c) {
    const float* plane = image + c * g->H * g->W;
    for (int64_t i = 0; i < g->KH; ++i) {
      for (int64_t j = 0; j < g->KW; ++j) {
        float* row = cols + ((c * g->KH + i) * g->KW + j) * ld;
        int64_t x0 = j * g->rhs_dilation[1] - g->pad[1];
        /* When reads are contiguous, output columns [x_lo, x_hi) lie inside the image, the rest are zero. */
        int64_t x_lo = x0 < 0 ? -x0 : 0, x_hi = g->W - x0;
        if (x_lo > g->OW) x_lo = g->OW;
        if (x_hi > g->OW) x_hi = g->OW;
        if (x_hi < x_lo) x_hi = x_lo;
        for (int64_t y = 0; y < g->OH; ++y) {
          float* out = row + y * g->OW;
          int64_t yd = y * g->stride[0] - g->pad[0] + i * g->rhs_dilation[0];
          if (yd < 0 || yd >= dilated_h || (g->lhs_dilation[0] > 1 && yd % g->lhs_dilation[0] != 0)) {
            memset(out, 0, (size_t)g->OW * sizeof *out);
            continue;
          }
          const float* line = plane + (g->lhs_dilation[0] > 1 ? yd / g->lhs_dilation[0] : yd) * g->W;
          if (contiguous) { /* rows are short (a few to a few dozen elements): loops, not library calls */
            float* restrict target = out;
            const float* restrict source = line + x0;
            for (int64_t x = 0; x < x_lo; ++x) target[x] = 0.0f;
            for (int64_t x = x_lo; x < x_hi; ++x) target[x] = source[x];
            for (int64_t x = x_hi; x < g->OW; ++x) target[x] = 0.0f;
          } else if (g->lhs_dilation[1] == 1) {
            for (int64_t x = 0; x < g->OW; ++x) {
              int64_t xd = x * g->stride[1] + x0;
              out[x] = xd < 0 || xd >= g->W ? 0.0f : line[xd];
            }
          } else {
            for (int64_t x = 0; x < g->OW; ++x) {
              int64_t xd = x * g->stride[1] + x0;
              out[x] = xd < 0 || xd >= dilated_w || xd % g->lhs_dilation[1] != 0 ? 0.0f
                                                                                 : line[xd / g->lhs_dilation[1]];
            }
          }
        }
      }
    }
  }
}

/* The adjoint of im2col without input dilation: image ([C, H, W]) = 0, then each cols[(c*KH + i)*KW + j]
 * [y*OW + x] (rows `ld` apart) is added to image[c][y*stride - pad + i*rhs_dilation][...] where that lies
 * inside. */
static void col2im(const conv_geometry* g, const float* cols, int64_t ld, float* image) {
  memset(image, 0, (size_t)(g->C * g->H * g->W) * sizeof *image);
  for (int64_t c = 0; c < g->C; ++c) {
    float* plane = image + c * g->H * g->W;
    for (int64_t i = 0; i < g->KH; ++i) {
      for (int64_t j = 0; j < g->KW; ++j) {
        const float* row = cols + ((c * g->KH + i) * g->KW + j) * ld;
        int64_t v0 = j * g->rhs_dilation[1] - g->pad[1];
        for (int64_t y = 0; y < g->OH; ++y) {
          int64_t u = y * g->stride[0] - g->pad[0] + i * g->rhs_dilation[0];
          if (u < 0 || u >= g->H) continue;
          float* line = plane + u * g->W;
          const float* source = row + y * g->OW;
          if (g->stride[1] == 1) {
            int64_t x_lo = v0 < 0 ? -v0 : 0, x_hi = g->W - v0 < g->OW ? g->W - v0 : g->OW;
            for (int64_t x = x_lo; x < x_hi; ++x) line[x + v0] += source[x];
          } else {
            for (int64_t x = 0; x < g->OW; ++x) {
              int64_t v = x * g->stride[1] + v0;
              if (v >= 0 && v < g->W) line[v] += source[x];
            }
          }
        }
      }
    }
  }
}

/* dst[r][t*n + e] = src[t][r][e] for t < count, r < rows, e < n: images' [rows, n] matrices side by side. */
static void side_by_side(const float* src, int64_t count, int64_t rows, int64_t n, float* dst) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t r = 0; r < rows; ++r)
      memcpy(dst + r * count * n + t * n, src + (t * rows + r) * n, (size_t)n * sizeof *dst);
}

/* The inverse of side_by_side. */
static void one_by_one(const float* src, int64_t count, int64_t rows, int64_t n, float* dst) {
  for (int64_t t = 0; t < count; ++t)
    for (int64_t r = 0; r < rows; ++r)
      memcpy(dst + (t * rows + r) * n, src + r * count * n + t * n, (size_t)n * sizeof *dst);
}

enum { MAX_CONV_WORKERS = 64 };

typedef struct {
  atomic_int holders, next_group, groups_done, next_slot;
  int groups_used[MAX_CONV_WORKERS]; /* per slot: groups it computed (read by the caller after groups_done) */
  conv_geometry geometry;
  int64_t mode, batch, group, groups, O, K, slot_floats;
  const float *lhs, *kernel, *rhs;
  float *result, *scratch;
} conv_job;

static void conv_release(conv_job* job) {
  if (atomic_fetch_sub_explicit(&job->holders, 1, memory_order_acq_rel) == 1) free(job);
}

/* One group of `count` images starting at image `first`, with this worker's columns, staging and partial. */
static void conv_group(const conv_job* job, int64_t first, int64_t count, float* cols, float* staging,
                       float* partial, int accumulate) {
  const conv_geometry* g = &job->geometry;
  int64_t O = job->O, K = job->K, image = g->C * g->H * g->W, P = g->OH * g->OW, n_all = count * P;
  const float one = 1.0f, zero = 0.0f;
  int m, n, k, lda, ldb, ldc;
  if (job->mode == 2) { /* column-major: cols^T [count*P, K] = gy^T [count*P, O] @ kernel [O, K] */
    const float* gy = job->lhs + first * O * P;
    if (count > 1) side_by_side(gy, count, O, P, staging), gy = staging;
    m = (int)n_all, n = (int)K, k = (int)O, lda = (int)n_all, ldb = (int)K, ldc = (int)n_all;
    gemm_f32("N", "T", &m, &n, &k, &one, gy, &lda, job->kernel, &ldb, &zero, cols, &ldc);
    for (int64_t t = 0; t < count; ++t) col2im(g, cols + t * P, n_all, job->result + (first + t) * image);
    return;
  }
  for (int64_t t = 0; t < count; ++t) im2col(g, job->lhs + (first + t) * image, cols + t * P, n_all);
  if (job->mode == 0) { /* column-major: y^T [count*P, O] = cols^T [count*P, K] @ kernel^T [K, O] */
    float* y = count > 1 ? staging : job->result + first * O * P;
    m = (int)n_all, n = (int)O, k = (int)K, lda = (int)n_all, ldb = (int)K, ldc = (int)n_all;
    gemm_f32("N", "N", &m, &n, &k, &one, cols, &lda, job->kernel, &ldb, &zero, y, &ldc);
    if (count > 1) one_by_one(staging, count, O, P, job->result + first * O * P);
    return;
  }
  /* column-major: partial^T [K, O] (+)= cols [K, count*P] @ gy^T [count*P, O] */
  const float* gy = job->rhs + first * O * P;
  if (count > 1) side_by_side(gy, count, O, P, staging), gy = staging;
  m = (int)K, n = (int)O, k = (int)n_all, lda = (int)n_all, ldb = (int)n_all, ldc = (int)K;
  gemm_f32("T", "N", &m, &n, &k, &one, cols, &lda, gy, &ldb, accumulate ? &one : &zero, partial, &ldc);
}

/* Claims a slot, then groups until none is left. */
static void conv_work(conv_job* job) {
  int slot = atomic_fetch_add_explicit(&job->next_slot, 1, memory_order_relaxed);
  const conv_geometry* g = &job->geometry;
  int64_t columns = job->group * g->OH * g->OW;
  float* cols = job->scratch + (int64_t)slot * job->slot_floats;
  float* staging = cols + job->K * columns;
  /* Slot 0 sums the kernel gradient into the result itself; the others into their own partial. */
  float* partial = slot == 0 ? job->result : staging + job->O * columns;
  int used = 0;
  for (;;) {
    int64_t index = atomic_fetch_add_explicit(&job->next_group, 1, memory_order_relaxed);
    if (index >= job->groups) break;
    int64_t first = index * job->group;
    int64_t count = job->batch - first < job->group ? job->batch - first : job->group;
    conv_group(job, first, count, cols, staging, partial, used > 0);
    job->groups_used[slot] = ++used;
    atomic_fetch_add_explicit(&job->groups_done, 1, memory_order_release);
  }
}

static void conv_task(void* data) {
  single_blas_thread_on_xla_pool();
  conv_work((conv_job*)data);
  conv_release((conv_job*)data);
}

static void drop_error(const XLA_FFI_Api* api, XLA_FFI_Error* failed) {
  XLA_FFI_Error_Destroy_Args destroy;
  memset(&destroy, 0, sizeof destroy);
  destroy.struct_size = XLA_FFI_Error_Destroy_Args_STRUCT_SIZE;
  destroy.error = failed;
  api->XLA_FFI_Error_Destroy(&destroy);
}

/* Threads in XLA's intra-op pool for this call, 0 when there is none. */
static int64_t pool_threads(const XLA_FFI_CallFrame* frame) {
  int64_t threads = 0;
  if (frame->api->XLA_FFI_ThreadPool_NumThreads == NULL || frame->api->XLA_FFI_ThreadPool_Schedule == NULL) return 0;
  XLA_FFI_ThreadPool_NumThreads_Args args;
  memset(&args, 0, sizeof args);
  args.struct_size = XLA_FFI_ThreadPool_NumThreads_Args_STRUCT_SIZE;
  args.ctx = frame->ctx;
  args.num_threads = &threads;
  XLA_FFI_Error* failed = frame->api->XLA_FFI_ThreadPool_NumThreads(&args);
  if (failed != NULL) {
    drop_error(frame->api, failed);
    return 0;
  }
  return threads;
}

static XLA_FFI_Error* bad(const XLA_FFI_CallFrame* frame, const char* message) {
  return error(frame->api, XLA_FFI_Error_Code_INVALID_ARGUMENT, message);
}

XLA_FFI_Error* tpucompile_host_conv(XLA_FFI_CallFrame* frame) {
  if (frame->struct_size < XLA_FFI_CallFrame_STRUCT_SIZE) return bad(frame, "tpucompile_host_conv: call frame too small");
  if (frame->extension_start != NULL && frame->extension_start->type == XLA_FFI_Extension_Metadata) {
    return describe_handler(frame);
  }
  if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE) return NULL;
  if (frame->args.size != 2 || frame->rets.size != 2 || frame->args.types[0] != XLA_FFI_ArgType_BUFFER ||
      frame->args.types[1] != XLA_FFI_ArgType_BUFFER || frame->rets.types[0] != XLA_FFI_RetType_BUFFER ||
      frame->rets.types[1] != XLA_FFI_RetType_BUFFER) {
    return bad(frame, "tpucompile_host_conv: expects two operand buffers and two result buffers");
  }
  const XLA_FFI_Buffer* lhs = (const XLA_FFI_Buffer*)frame->args.args[0];
  const XLA_FFI_Buffer* rhs = (const XLA_FFI_Buffer*)frame->args.args[1];
  const XLA_FFI_Buffer* out = (const XLA_FFI_Buffer*)frame->rets.rets[0];
  const XLA_FFI_Buffer* scratch = (const XLA_FFI_Buffer*)frame->rets.rets[1];
  if (lhs->rank != 4 || rhs->rank != 4 || out->rank != 4 || scratch->rank != 1 || gemm_f32 == NULL ||
      lhs->dtype != XLA_FFI_DataType_F32 || rhs->dtype != XLA_FFI_DataType_F32 ||
      out->dtype != XLA_FFI_DataType_F32 || scratch->dtype != XLA_FFI_DataType_F32) {
    return bad(frame, "tpucompile_host_conv: expects f32 rank-4 operands and result and a rank-1 f32 scratch");
  }
  conv_geometry g;
  int64_t mode = -1, kernel_io = 0, group = 0;
  int found = scalar(frame, "mode", &mode) & scalar(frame, "kernel_io", &kernel_io) &
              scalar(frame, "group", &group) & scalar(frame, "stride_h", &g.stride[0]) &
              scalar(frame, "stride_w", &g.stride[1]) & scalar(frame, "pad_h", &g.pad[0]) &
              scalar(frame, "pad_w", &g.pad[1]) & scalar(frame, "lhs_dilation_h", &g.lhs_dilation[0]) &
              scalar(frame, "lhs_dilation_w", &g.lhs_dilation[1]) &
              scalar(frame, "rhs_dilation_h", &g.rhs_dilation[0]) &
              scalar(frame, "rhs_dilation_w", &g.rhs_dilation[1]);
  if (!found || mode < 0 || mode > 2 || group < 1 || g.stride[0] < 1 || g.stride[1] < 1 ||
      g.lhs_dilation[0] < 1 || g.lhs_dilation[1] < 1 || g.rhs_dilation[0] < 1 || g.rhs_dilation[1] < 1 ||
      (mode != 0 && (g.lhs_dilation[0] != 1 || g.lhs_dilation[1] != 1))) {
    return bad(frame, "tpucompile_host_conv: bad attributes");
  }
  /* The image side ([B, C, H, W]: x, or gx in mode 2) and the position side ([B, O, OH, OW]: y or gy). */
  const XLA_FFI_Buffer* images = mode == 2 ? out : lhs;
  const XLA_FFI_Buffer* positions = mode == 0 ? out : mode == 1 ? rhs : lhs;
  const XLA_FFI_Buffer* kernel = mode == 1 ? out : rhs;
  int64_t batch = images->dims[0], O = positions->dims[1];
  g.C = images->dims[1], g.H = images->dims[2], g.W = images->dims[3];
  g.OH = positions->dims[2], g.OW = positions->dims[3], g.KH = kernel->dims[2], g.KW = kernel->dims[3];
  int io = mode == 1 ? 0 : (int)kernel_io; /* kernel [C, O, ...] rather than [O, C, ...] */
  if (mode == 2) io = !io;                 /* the transposed convolution's kernel swaps the roles */
  if (positions->dims[0] != batch || kernel->dims[io ? 0 : 1] != g.C || kernel->dims[io ? 1 : 0] != O) {
    return bad(frame, "tpucompile_host_conv: shapes disagree");
  }
  int64_t K = g.C * g.KH * g.KW, P = g.OH * g.OW, columns = group * P;
  if (K > 2147483647 || O > 2147483647 || columns > 2147483647) {
    return bad(frame, "tpucompile_host_conv: sizes exceed BLAS integers");
  }
  float* result = (float*)out->data;
  int64_t result_floats = mode == 1 ? O * K : mode == 0 ? batch * O * P : batch * g.C * g.H * g.W;
  if (batch == 0 || K == 0 || P == 0 || O == 0 || (mode == 0 && g.H * g.W == 0)) {
    memset(result, 0, (size_t)result_floats * sizeof *result);
    return NULL;
  }
  int64_t slot_floats = K * columns + O * columns + (mode == 1 ? O * K : 0);
  int64_t packed_floats = mode == 2 || (mode == 0 && io) ? O * K : 0; /* the repacked kernel, shared */
  int64_t slots = (scratch->dims[0] - packed_floats) / slot_floats;
  if (slots < 1) return bad(frame, "tpucompile_host_conv: scratch too small");
  const float* weights = (const float*)kernel->data;
  float* workspace = (float*)scratch->data;
  if (packed_floats) { /* the forward's kernel as [O, C*KH*KW] */
    float* packed = workspace + slots * slot_floats;
    int64_t taps = g.KH * g.KW;
    for (int64_t c = 0; c < g.C; ++c)
      for (int64_t o = 0; o < O; ++o) {
        const float* source = weights + (io ? c * O + o : o * g.C + c) * taps;
        float* target = packed + o * K + c * taps;
        if (mode == 2) { /* reversed back */
          for (int64_t t = 0; t < taps; ++t) target[t] = source[taps - 1 - t];
        } else {
          memcpy(target, source, (size_t)taps * sizeof *target);
        }
      }
    weights = packed;
  }
  int64_t groups = (batch + group - 1) / group;
  int64_t workers = slots < groups ? slots : groups, threads = pool_threads(frame);
  if (workers > threads) workers = threads > 0 ? threads : 1;
  if (workers > MAX_CONV_WORKERS) workers = MAX_CONV_WORKERS;
  conv_job* job = (conv_job*)calloc(1, sizeof *job);
  if (job == NULL) return error(frame->api, XLA_FFI_Error_Code_RESOURCE_EXHAUSTED, "tpucompile_host_conv: no memory");
  atomic_init(&job->holders, 1);
  job->geometry = g;
  job->mode = mode, job->batch = batch, job->group = group, job->groups = groups, job->O = O, job->K = K;
  job->slot_floats = slot_floats;
  job->lhs = (const float*)lhs->data, job->kernel = weights, job->rhs = (const float*)rhs->data;
  job->result = result, job->scratch = workspace;
  /* With helpers, the calling thread's BLAS runs single-threaded for the duration of this call (its count
   * is restored before returning): the helpers are the parallelism. Leaving the count alone helped training
   * steps (torch's OpenMP team is awake then, from the eager loss and optimiser) less than it hurt inference. */
  int previous_blas_threads = -1;
  if (workers > 1 && blas_threads_local != NULL) previous_blas_threads = blas_threads_local(1);
  for (int64_t t = 1; t < workers; ++t) {
    atomic_fetch_add_explicit(&job->holders, 1, memory_order_relaxed);
    XLA_FFI_ThreadPool_Schedule_Args args;
    memset(&args, 0, sizeof args);
    args.struct_size = XLA_FFI_ThreadPool_Schedule_Args_STRUCT_SIZE;
    args.ctx = frame->ctx;
    args.task = conv_task;
    args.data = job;
    XLA_FFI_Error* failed = frame->api->XLA_FFI_ThreadPool_Schedule(&args);
    if (failed != NULL) { /* not scheduled: the groups are left to the workers there are */
      drop_error(frame->api, failed);
      atomic_fetch_sub_explicit(&job->holders, 1, memory_order_relaxed);
      workers = t;
      break;
    }
  }
  conv_work(job);
  while (atomic_load_explicit(&job->groups_done, memory_order_acquire) < groups) sched_yield();
  if (previous_blas_threads >= 0) blas_threads_local(previous_blas_threads);
  if (mode == 1) { /* slot 0 summed into `result` directly, the others into their partials */
    if (job->groups_used[0] == 0) memset(result, 0, (size_t)result_floats * sizeof *result);
    for (int64_t slot = 1; slot < workers; ++slot) {
      if (job->groups_used[slot] == 0) continue;
      const float* partial = workspace + slot * slot_floats + K * columns + O * columns;
      for (int64_t e = 0; e < result_floats; ++e) result[e] += partial[e];
    }
  }
  conv_release(job);
  return NULL;
}
