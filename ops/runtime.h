// Per-process state shared by the prophet_tf kernels and the Python engine.
//
// One library (_prophet_ops.so) holds both the TensorFlow kernels and the
// `extern "C"` API below. Python loads it twice, with tf.load_op_library and
// ctypes.CDLL on the same path; dlopen returns the same handle for the same
// file, so both see the one Runtime instance defined in runtime.cc.
//
// The runtime holds three things:
//   * a bounded stamp buffer: (key, step, t_ns, kind) records written by the
//     kernels and by the engine, drained by the profiler. When full, records
//     are counted as dropped; a writer never blocks on a reader.
//   * a gradient queue: PushGrad enqueues {key, step, Tensor}; the engine pops
//     with prophet_next_grad and releases with prophet_release_grad. A Tensor
//     copy shares its buffer, so no gradient bytes are copied.
//   * parameter staging: the engine declares each parameter (dtype, shape),
//     opens a fresh Tensor for a pulled version (prophet_deliver_begin),
//     copies the received parts into it (prophet_deliver_write, which checks
//     every byte range against the declared size) and publishes it
//     (prophet_deliver_commit), which completes every pending AwaitParam
//     whose step <= the delivered version. Readers hold their own reference
//     to the Tensor they got, so a later delivery never changes a value a
//     step is still using; a write holds one too, so a cancel, reset or
//     failed commit racing with it never frees the memory it copies into.
//     No pointer into staging memory ever leaves the runtime.
//
// Thread-safety: every function here may be called from any thread.
// Blocking C functions (prophet_next_grad) block without the GIL because
// ctypes.CDLL releases it around foreign calls.

#ifndef PROPHET_TF_OPS_RUNTIME_H_
#define PROPHET_TF_OPS_RUNTIME_H_

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.pb.h"

extern "C" {

// Kinds of stamp records. Values 0..15 are reserved for the runtime; other
// events recorded through prophet_stamp should use kinds >= 16. Python's one
// definition is prophet_tf.engine.timeline.StampKind; a unit test compares the
// two through prophet_stamp_kind_name.
enum ProphetStampKind {
  PROPHET_STAMP_READY = 0,        // gradient ready (ReadyStamp / PushGrad ran)
  PROPHET_STAMP_AWAIT_BEGIN = 1,  // AwaitParam started waiting
  PROPHET_STAMP_AWAIT_END = 2,    // AwaitParam completed: the forward can go on
  PROPHET_STAMP_DELIVER = 3,      // the engine committed a parameter value
};

// Return codes of the C API. Negative means the call did nothing.
enum ProphetStatus {
  PROPHET_OK = 0,
  PROPHET_ERR_ABORTED = -1,        // prophet_abort was called
  PROPHET_ERR_INVALID = -2,        // bad argument (dtype, dims, version < 0, NULL)
  PROPHET_ERR_UNDECLARED = -3,     // parameter key was never declared
  PROPHET_ERR_VERSION_ORDER = -4,  // version older than the staged one
  PROPHET_ERR_NO_DELIVERY = -5,    // commit without a matching deliver_begin
  PROPHET_ERR_CONFLICT = -6,       // re-declaration with another dtype/shape
  PROPHET_ERR_BOUNDS = -7,         // a write outside the parameter's bytes
  PROPHET_ERR_BUSY = -8,           // commit while a write into it is in progress
};

// 32 bytes, no implicit padding; mirrored by a numpy structured dtype.
typedef struct ProphetStamp {
  int64_t key;
  int64_t step;
  int64_t t_ns;  // CLOCK_MONOTONIC, nanoseconds (== time.monotonic_ns())
  int32_t kind;  // ProphetStampKind, or a caller-defined kind >= 16
  int32_t reserved;
} ProphetStamp;

// One gradient handed to the engine. `data` stays valid until
// prophet_release_grad(handle) (or prophet_reset).
typedef struct ProphetGradInfo {
  int64_t key;
  int64_t step;
  const void* data;
  int64_t nbytes;
  int64_t handle;
  int32_t dtype;  // tensorflow::DataType enum value (DT_FLOAT = 1, ...)
  int32_t reserved;
  int64_t ready_ns;  // when PushGrad ran (same clock as the stamps)
} ProphetGradInfo;

int64_t prophet_now_ns(void);
void prophet_stamp(int64_t key, int64_t step, int32_t kind);
int64_t prophet_drain_stamps(ProphetStamp* out, int64_t max);
int64_t prophet_stamps_dropped(void);
int64_t prophet_stamp_capacity(void);
// The enumerator name of a ProphetStampKind without its prefix ("READY"), or
// NULL for a value that is no kind.
const char* prophet_stamp_kind_name(int32_t kind);
// Records n stamps (key = 0..n-1, step 0, `kind`) in a tight loop and returns
// the elapsed ns: the raw cost of a stamp, for benchmarks/bench_ops.py.
int64_t prophet_stamp_benchmark(int64_t n, int32_t kind);

int prophet_next_grad(int64_t timeout_us, ProphetGradInfo* out);
void prophet_release_grad(int64_t handle);
int64_t prophet_outstanding_grads(void);
int64_t prophet_queued_grads(void);

int prophet_declare_param(int64_t key, int32_t dtype, int32_t ndims, const int64_t* dims);
// Opens (or finds the open) delivery of `key` at `version`.
int prophet_deliver_begin(int64_t key, int64_t version);
// Copies `nbytes` bytes from `src` to byte `offset` of the open delivery;
// PROPHET_ERR_BOUNDS (nothing written) unless 0 <= offset and
// offset + nbytes <= the parameter's size. Writes to disjoint ranges may run
// in parallel; the copy runs outside the runtime's lock.
int prophet_deliver_write(int64_t key, int64_t version, int64_t offset, const void* src,
                          int64_t nbytes);
int prophet_deliver_commit(int64_t key, int64_t version);
int prophet_deliver_cancel(int64_t key, int64_t version);
int64_t prophet_param_nbytes(int64_t key);
int64_t prophet_param_version(int64_t key);
int32_t prophet_param_dtype(int64_t key);
int prophet_freeze_param(int64_t key);
int64_t prophet_pending_awaits(void);

void prophet_abort(const char* message);
void prophet_reset(void);
const char* prophet_last_error(void);
int prophet_last_error_code(void);

}  // extern "C"

namespace prophet_tf {

int64_t NowNs();
// Records (key, step, now, kind); returns `now`. Never blocks on a reader;
// counts the record as dropped when the buffer is full.
int64_t RecordStamp(int64_t key, int64_t step, int32_t kind);

// Hands `grad` (by reference: the Tensor shares its buffer) to the engine.
// Returns Aborted after prophet_abort.
absl::Status EnqueueGrad(int64_t key, int64_t step, const tensorflow::Tensor& grad,
                         int64_t ready_ns);

// Called exactly once with the outcome of an AwaitParam request. On success
// `value` is the staged Tensor; otherwise it is an empty Tensor.
using AwaitCallback =
    std::function<void(const absl::Status& status, const tensorflow::Tensor& value)>;

// Calls `callback` once parameter `key` is staged at a version >= `step`:
// inline when it already is (or when the request fails at once), otherwise
// from the thread that commits the delivery, aborts, resets or cancels.
// `cm` (may be null) cancels the wait when the step is cancelled.
void AwaitParam(int64_t key, int64_t step, tensorflow::DataType dtype,
                const tensorflow::PartialTensorShape& shape,
                tensorflow::CancellationManager* cm, AwaitCallback callback);

}  // namespace prophet_tf

#endif  // PROPHET_TF_OPS_RUNTIME_H_
