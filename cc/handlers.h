// Every FFI handler symbol, one line each; module.cc exposes them as capsules.
#pragma once

#include "xla/ffi/api/api.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(Glm5ExpandPools);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Glm5ExpandAndRemap);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Glm5KpoolUpdate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Glm5IndexerProjection);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Glm5IndexerProjectionFused);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Glm5IndexerQuery);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Glm5UpcastLogits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Glm5MqaLogits);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Glm5PoolTopk);
XLA_FFI_DECLARE_HANDLER_SYMBOL(Glm5SelectPools);
