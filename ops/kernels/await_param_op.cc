// AwaitParam: outputs parameter `key` once it is staged at version >= step.

#include <thread>

#include "absl/strings/str_cat.h"
#include "emulated_clock.h"
#include "kernels/kernel_util.h"
#include "runtime.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor_shape.h"

namespace prophet_tf {

using tensorflow::AsyncOpKernel;
using tensorflow::DataType;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::PartialTensorShape;
using tensorflow::Tensor;

// No thread waits: a request that cannot be served yet is parked in the
// runtime with its done callback; the engine thread that commits the
// delivery (or an abort, reset or step cancellation) completes it.
class AwaitParamOp : public AsyncOpKernel {
 public:
  explicit AwaitParamOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("key", &key_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shape", &shape_));
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    OP_REQUIRES_ASYNC(ctx, !IsConstantFolding(ctx), NotFoldable("AwaitParam"), done);
    int64_t step = 0;
    OP_REQUIRES_OK_ASYNC(ctx, ReadStep("AwaitParam", ctx->input(0), &step), done);
    OP_REQUIRES_ASYNC(ctx, step >= 0,
                      absl::InvalidArgumentError(absl::StrCat(
                          "AwaitParam: step must be >= 0. Received: step=", step)),
                      done);
    RecordStamp(key_, step, PROPHET_STAMP_AWAIT_BEGIN);
    const int64_t key = key_;
    const DataType dtype = dtype_;
    const PartialTensorShape shape = shape_;
    // After AwaitParam returns, `ctx` may already be gone (the callback may
    // have run on another thread): touch nothing but the callback below.
    // The callback runs on this thread only when the parameter was already
    // there; otherwise the arrival ends a wait the emulated device saw too.
    const std::thread::id caller = std::this_thread::get_id();
    AwaitParam(key_, step, dtype_, shape_, ctx->cancellation_manager(),
               [ctx, done = std::move(done), key, step, dtype, shape, caller](
                   const absl::Status& status, const Tensor& value) {
                 if (!status.ok()) {
                   ctx->SetStatus(status);
                 } else if (value.dtype() != dtype || !shape.IsCompatibleWith(value.shape())) {
                   ctx->SetStatus(absl::InvalidArgumentError(absl::StrCat(
                       "AwaitParam(key=", key, ") expects dtype=", tensorflow::DataTypeString(dtype),
                       ", shape=", shape.DebugString(), ". Received: dtype=",
                       tensorflow::DataTypeString(value.dtype()), ", shape=", value.shape().DebugString())));
                 } else {
                   ctx->set_output(0, value);  // shares the staged buffer
                   RecordStamp(key, step, PROPHET_STAMP_AWAIT_END);
                   if (EmulatedClockInUse() && std::this_thread::get_id() != caller) {
                     NoteDataReady(EmulatedClock::now());
                   }
                 }
                 done();
               });
  }

  // Starting the op is cheap (the wait, if any, holds no thread): run it
  // inline on the thread that made it ready instead of hopping to the pool.
  bool IsExpensive() override { return false; }

 private:
  int64_t key_;
  DataType dtype_;
  PartialTensorShape shape_;
};

REGISTER_KERNEL_BUILDER(Name("AwaitParam").Device(tensorflow::DEVICE_CPU), AwaitParamOp);

}  // namespace prophet_tf
