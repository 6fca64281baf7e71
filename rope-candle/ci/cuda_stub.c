/* A stand-in for the CUDA driver (libcuda.so.1) on machines without one, so that test binaries
   of candle's `cuda` feature, which link the driver, link and start; every entry returns
   CUDA_ERROR_NO_DEVICE (100), so GPU tests skip. The names are the driver functions such a
   binary references (candle-core 0.11.1, cudarc 0.19.10, rope-host's launches). Never
   installed next to a real driver. */
int cuCtxDestroy_v2(void) { return 100; }
int cuCtxGetCurrent(void) { return 100; }
int cuCtxSetCurrent(void) { return 100; }
int cuDeviceGet(void) { return 100; }
int cuDeviceGetAttribute(void) { return 100; }
int cuDevicePrimaryCtxRelease_v2(void) { return 100; }
int cuDevicePrimaryCtxRetain(void) { return 100; }
int cuEventCreate(void) { return 100; }
int cuEventDestroy_v2(void) { return 100; }
int cuEventRecord(void) { return 100; }
int cuGetErrorString(void) { return 100; }
int cuInit(void) { return 100; }
int cuLaunchKernel(void) { return 100; }
int cuLaunchKernelEx(void) { return 100; }
int cuMemAllocAsync(void) { return 100; }
int cuMemAlloc_v2(void) { return 100; }
int cuMemFreeAsync(void) { return 100; }
int cuMemFree_v2(void) { return 100; }
int cuMemcpyDtoDAsync_v2(void) { return 100; }
int cuMemcpyDtoHAsync_v2(void) { return 100; }
int cuMemcpyHtoDAsync_v2(void) { return 100; }
int cuMemcpyPeerAsync(void) { return 100; }
int cuMemsetD8Async(void) { return 100; }
int cuModuleGetFunction(void) { return 100; }
int cuModuleLoad(void) { return 100; }
int cuModuleLoadData(void) { return 100; }
int cuModuleUnload(void) { return 100; }
int cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(void) { return 100; }
int cuStreamDestroy_v2(void) { return 100; }
int cuStreamIsCapturing(void) { return 100; }
int cuStreamSynchronize(void) { return 100; }
int cuStreamWaitEvent(void) { return 100; }
