//! Generates the KEDA external scaler gRPC code from `proto/externalscaler.proto` with the protoc that
//! `protoc-bin-vendored` ships (nothing to install; a `PROTOC` set in the environment wins).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    }
    tonic_prost_build::configure().build_client(true).build_server(true).compile_protos(&["proto/externalscaler.proto"], &["proto"])?;
    Ok(())
}
