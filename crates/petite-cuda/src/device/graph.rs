//! CUDA graphs and timing: events on the stream ([`Mark`]) and captured work replayed as one
//! launch ([`Graph`]).

use cudarc::driver::sys as dsys;

use super::Device;
use crate::{Error, Result, driver};

/// A point on the device's stream ([`Device::mark`]).
pub struct Mark(cudarc::driver::CudaEvent);

impl Mark {
    /// Milliseconds of device time from `self` to `later` (waits for both).
    pub fn ms_to(&self, later: &Mark) -> Result<f64> {
        self.0
            .elapsed_ms(&later.0)
            .map(f64::from)
            .map_err(driver("event elapsed time"))
    }
}

/// A captured sequence of the stream's work, replayed as one CUDA graph launch.
pub struct Graph(cudarc::driver::CudaGraph);

impl Graph {
    /// Queues one replay on the stream it was captured from.
    pub fn launch(&self) -> Result<()> {
        self.0.launch().map_err(driver("launch graph"))
    }
}

impl Device {
    /// A timing event recorded on the stream now (CUDA events: device time, not host time).
    pub fn mark(&self) -> Result<Mark> {
        let e = self
            .ctx
            .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("create event"))?;
        e.record(&self.stream).map_err(driver("record event"))?;
        Ok(Mark(e))
    }

    /// Captures the work `f` queues on the stream (nothing runs) into a [`Graph`]: `f` must not
    /// wait for the device; buffers it allocates and frees become the graph's own.
    pub fn capture<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<(R, Graph)> {
        self.stream
            .begin_capture(dsys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("begin capture"))?;
        let r = f();
        let g = self
            .stream
            .end_capture(dsys::CUgraphInstantiate_flags(0))
            .map_err(driver("end capture"));
        let r = r?;
        let g = g?.ok_or_else(|| Error::Plan("captured an empty graph".into()))?;
        Ok((r, Graph(g)))
    }
}
