"""A custom CUDA kernel that writes far past its output. Run under compute-sanitizer memcheck, it
must be reported (an "Invalid __global__ write"): the check that the tool sees MLX's kernels."""

import mlx.core as mx

kernel = mx.fast.cuda_kernel(
    name="planted_oob", input_names=["x"], output_names=["out"],
    source="unsigned int i = threadIdx.x; out[(size_t)i + (1ull << 38)] = x[i];",
)
x = mx.ones((32,), mx.float32)
(out,) = kernel(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
                output_dtypes=[mx.float32])
mx.eval(out)
print("planted kernel ran")
