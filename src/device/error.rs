//! The errors of the device path as the operators see them: a [`DeviceError`] is what an
//! operator falls back to its CPU path from; any other error is the query's own.

use std::fmt;

use datafusion::error::DataFusionError;

use super::GpuError;

/// A failure of the device path: a driver, memory or compile error, an injected fault, no
/// GPU, or a row whose outcome only the host reproduces. The operator finishes the query on
/// the CPU path on it; any other error is the query's own (DataFusion's) and fails it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceError(pub String);

impl DeviceError {
    /// As the `DataFusionError` it travels in (an external error).
    pub fn into_error(self) -> DataFusionError {
        DataFusionError::External(Box::new(self))
    }

    /// The device error `error` carries, wherever it is in its chain of sources (a context, a
    /// shared error or an Arrow error may wrap it on the way).
    pub fn find(error: &DataFusionError) -> Option<&DeviceError> {
        let mut next: Option<&(dyn std::error::Error + 'static)> = Some(error);
        while let Some(e) = next {
            if let Some(found) = e.downcast_ref::<DeviceError>() {
                return Some(found);
            }
            next = e.source();
        }
        None
    }
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DeviceError {}

/// A fault of the device runtime, as the [`DeviceError`] the operator falls back from.
pub(crate) fn gpu_error(e: GpuError) -> DataFusionError {
    DeviceError(format!("CUDA top-k selection failed: {e}")).into_error()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use datafusion::arrow::error::ArrowError;

    /// A device error is found through the wrappers an error picks up on its way (a context,
    /// a shared error, an Arrow error); an external error of another kind is not one.
    #[test]
    fn a_device_error_is_found_by_its_type_through_wrappers() {
        let device = || DeviceError("launch failed".into()).into_error();
        let wrapped = [
            device(),
            device().context("reading a batch"),
            DataFusionError::Shared(Arc::new(device())),
            DataFusionError::ArrowError(
                Box::new(ArrowError::ExternalError(Box::new(device()))),
                None,
            ),
        ];
        for error in &wrapped {
            let found = DeviceError::find(error).map(|e| e.0.as_str());
            assert_eq!(found, Some("launch failed"), "{error:?}");
        }
        let other = DataFusionError::External("[gpu-topk device] a look-alike".into());
        assert_eq!(DeviceError::find(&other), None);
        assert_eq!(
            DeviceError::find(&DataFusionError::Execution("x".into())),
            None
        );
    }
}
