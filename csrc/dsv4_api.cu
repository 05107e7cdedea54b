// The version and error strings of the C interface (dsv4_api.h).
#include <cuda_runtime.h>

#include "dsv4_api.h"

extern "C" {

// Version of this ABI (checked by the loader).
int dsv4_abi_version() { return 16; }

const char* dsv4_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // extern "C"
