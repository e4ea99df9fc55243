//! The scaling agent's integration tests, in one binary: the Kubernetes manifests it scales
//! (`k8s_manifests`). Its KEDA external scaler and process backend, tested with processors on
//! LocalStack, are in deploy/e2e.

mod k8s_manifests;
