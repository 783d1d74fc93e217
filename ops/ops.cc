// Op registrations of prophet_tf. Kernels live in ops/kernels/.
//
// Statefulness and tf.function's automatic control dependencies (ACD):
//   ACD chains every stateful op that has no resource input in program order.
//   A stateful ReadyStamp would make layer 0's stamp wait for layer 7's, and a
//   stateful AwaitParam would chain all forward reads (and any other stateful
//   op of the step, e.g. a tf.print, behind them).
//   * PushGrad takes its variable's resource handle and is stateful: ACD then
//     orders it only against other ops on that same variable (none in a
//     training step: reads go through AwaitParam), and keeps it although it has
//     no output, since Keras discards whatever the update returns.
//   * ReadyStamp and AwaitParam are plain value ops, with these consequences,
//     each acceptable here:
//   * Pruning: an op whose output nobody consumes is removed. ReadyStamp must
//     have its output used; an unused AwaitParam need not wait anyway.
//   * CSE: identical ops (same inputs and attrs) may be merged. `key` is an
//     attr, so ops of different parameters never merge; two AwaitParams of the
//     same key and step merge into one wait for the same value, which is fine.
//   * Constant folding: grappler and the graph optimiser fold a non-stateful
//     op whose inputs are all constants: they run the kernel once at
//     optimisation time and replace it by its result (measured: a ReadyStamp
//     on constants stamped once for three calls). The kernels detect that
//     context and fail there, so the fold is abandoned and the op kept (see
//     IsConstantFolding in kernels/kernel_util.h).

#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace prophet_tf {

using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

namespace {

// y = x, with input 1 (`step`, `seconds`) a scalar.
absl::Status PassThroughShape(InferenceContext* c) {
  ShapeHandle unused;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(1), 0, &unused));
  c->set_output(0, c->input(0));
  return absl::OkStatus();
}

absl::Status AwaitParamShape(InferenceContext* c) {
  ShapeHandle unused;
  TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
  tensorflow::PartialTensorShape shape;
  TF_RETURN_IF_ERROR(c->GetAttr("shape", &shape));
  ShapeHandle out;
  TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shape, &out));
  c->set_output(0, out);
  return absl::OkStatus();
}

}  // namespace

// Records (key, step, now, READY) and returns `x` (same buffer, no copy).
REGISTER_OP("ReadyStamp")
    .Input("x: T")
    .Input("step: int64")
    .Output("y: T")
    .Attr("key: int >= 0")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn(PassThroughShape);

// Stamps READY and hands `grad` (by reference) to the engine's gradient queue.
// Completes at once; never waits for the network. `variable` is the handle of
// the variable the gradient belongs to; it is not read (see the note above).
REGISTER_OP("PushGrad")
    .Input("variable: resource")
    .Input("grad: T")
    .Input("step: int64")
    .Attr("key: int >= 0")
    .Attr("T: {half, bfloat16, float, double}")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) {
      ShapeHandle unused;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(2), 0, &unused));
      return absl::OkStatus();
    });

// Waits until parameter `key` is staged at a version >= `step` and returns
// the staged tensor (shared buffer). Waiting holds no thread.
REGISTER_OP("AwaitParam")
    .Input("step: int64")
    .Output("value: dtype")
    .Attr("key: int >= 0")
    .Attr("dtype: {half, bfloat16, float, double}")
    .Attr("shape: shape")
    .SetShapeFn(AwaitParamShape);

// Returns `input` (same buffer) `seconds` after it starts, holding no thread
// and no CPU meanwhile: emulates a device computing while the host is free.
// Stateful so that it is never pruned, merged or folded; its Python wrapper
// exempts it from ACD's program-order chain (prophet_tf/bench/emulation.py).
// With hide_launch_gap it starts from the emulated device's clock, not from
// when the host got to it (emulated_clock.h).
REGISTER_OP("EmulatedDelay")
    .Input("input: T")
    .Input("seconds: float")
    .Output("output: T")
    .Attr("T: type")
    .Attr("hide_launch_gap: bool = false")
    .SetIsStateful()
    .SetShapeFn(PassThroughShape);

}  // namespace prophet_tf
