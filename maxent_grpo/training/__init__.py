"""Lightning-side training code: module, data, callbacks, metrics and types."""
