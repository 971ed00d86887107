// A kernel timeline for any CUDA program, without Nsight Systems: loaded with LD_PRELOAD, it
// subscribes to CUPTI's activity API when the program starts and writes one line per kernel,
// memory copy and memset executed on the GPU to $CUPTI_TRACE_OUT (default cupti_trace.csv):
//
//   kind,start_ns,end_ns,stream,bytes,name
//
// Timestamps are the GPU's own (CUPTI's clock), so they measure execution, not host enqueue.
// bench/kernel_split.py turns the file into the split of step time by kernel.
//
// Build (CUPTI headers and library of the CUDA 13.0 wheels, nvidia-cuda-cupti):
//   cc -O2 -shared -fPIC -I$CU/include -o cupti_trace.so bench/cupti_trace.c -L$CU/lib -l:libcupti.so.13
// Use:
//   CUPTI_TRACE_OUT=trace.csv LD_PRELOAD=./cupti_trace.so ./pretrain --recipe ...

#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUF_SIZE (8u << 20)
#define ALIGN 8

static FILE *out;

#define CHECK(call)                                                            \
  do {                                                                         \
    CUptiResult r_ = (call);                                                   \
    if (r_ != CUPTI_SUCCESS) {                                                 \
      const char *msg_ = "?";                                                  \
      cuptiGetResultString(r_, &msg_);                                         \
      fprintf(stderr, "cupti_trace: %s failed: %s\n", #call, msg_);            \
    }                                                                          \
  } while (0)

static void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *max_records) {
  uint8_t *b = aligned_alloc(ALIGN, BUF_SIZE);
  *buffer = b;
  *size = b ? BUF_SIZE : 0;
  *max_records = 0;
}

// Kernel names can hold commas (templates): quote them for CSV.
static void write_name(const char *name) {
  fputc('"', out);
  for (const char *c = name ? name : "?"; *c; c++) {
    if (*c == '"') fputc('"', out);
    fputc(*c, out);
  }
  fputs("\"\n", out);
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                              size_t valid) {
  (void)ctx;
  (void)stream;
  (void)size;
  CUpti_Activity *rec = NULL;
  while (out && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)rec;
        fprintf(out, "kernel,%llu,%llu,%u,0,", (unsigned long long)k->start,
                (unsigned long long)k->end, k->streamId);
        write_name(k->name);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)rec;
        static const char *kinds[] = {"?", "HtoD", "DtoH", "HtoA", "AtoH", "AtoA", "AtoD",
                                      "DtoA", "DtoD", "HtoH", "PtoP"};
        fprintf(out, "memcpy,%llu,%llu,%u,%llu,memcpy %s\n", (unsigned long long)m->start,
                (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes,
                m->copyKind < 11 ? kinds[m->copyKind] : "?");
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        CUpti_ActivityMemset4 *m = (CUpti_ActivityMemset4 *)rec;
        fprintf(out, "memset,%llu,%llu,%u,%llu,memset\n", (unsigned long long)m->start,
                (unsigned long long)m->end, m->streamId, (unsigned long long)m->bytes);
        break;
      }
      default:
        break;
    }
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped);
  if (dropped) fprintf(stderr, "cupti_trace: %zu records dropped\n", dropped);
  free(buffer);
}

__attribute__((constructor)) static void start(void) {
  const char *path = getenv("CUPTI_TRACE_OUT");
  out = fopen(path && *path ? path : "cupti_trace.csv", "w");
  if (!out) {
    perror("cupti_trace: cannot open the output file");
    return;
  }
  fputs("kind,start_ns,end_ns,stream,bytes,name\n", out);
  CHECK(cuptiActivityRegisterCallbacks(requested, completed));
  CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
  CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
  CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
  // Deliver full buffers every second as well, so a program that ends abruptly keeps most of its
  // timeline.
  CHECK(cuptiActivityFlushPeriod(1000));
}

__attribute__((destructor)) static void stop(void) {
  if (!out) return;
  CHECK(cuptiActivityFlushAll(1));
  fclose(out);
  out = NULL;
}
