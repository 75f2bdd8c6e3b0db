//! Prometheus text exposition: a small writer and an HTTP endpoint.
