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
#include <stddef.h>
#include <stdint.h>
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

/* An integer scalar attribute (attributes arrive sorted by name; there are two, so a scan is enough). */
static int flag(const XLA_FFI_CallFrame* frame, const char* name) {
  size_t length = strlen(name);
  for (int64_t i = 0; i < frame->attrs.size; ++i) {
    const XLA_FFI_ByteSpan* key = frame->attrs.names[i];
    if (key->len != length || memcmp(key->ptr, name, length) != 0) continue;
    if (frame->attrs.types[i] != XLA_FFI_AttrType_SCALAR) return -1;
    const XLA_FFI_Scalar* scalar = (const XLA_FFI_Scalar*)frame->attrs.attrs[i];
    switch (scalar->dtype) {
      case XLA_FFI_DataType_S64: return (int)*(const int64_t*)scalar->value;
      case XLA_FFI_DataType_S32: return (int)*(const int32_t*)scalar->value;
      default: return -1;
    }
  }
  return -1;
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
  int transpose_lhs = flag(frame, "transpose_lhs"), transpose_rhs = flag(frame, "transpose_rhs");
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
  /* On XLA's own pool threads (which XLA uses once a program has gone asynchronous) the BLAS runs on that
   * thread alone: an OpenMP team forked from there would compete with XLA's pool and torch's team for the
   * cores. The setting lasts for the thread, which only XLA uses. On every other thread (torch's, where the
   * program runs inline) the BLAS keeps the thread count torch and the user configured: the kernel does not
   * change per-thread state its caller owns (MKL already runs small products on one thread by itself). */
  if (blas_threads_local != NULL) {
    static _Thread_local int thread_checked = 0;
    if (!thread_checked) {
      char name[32] = {0};
      if (pthread_getname_np(pthread_self(), name, sizeof name) == 0 && strncmp(name, "tf_XLA", 6) == 0) {
        blas_threads_local(1);
      }
      thread_checked = 1;
    }
  }
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
