//! Turns on the mutation switches (`controller_core::undo`) for this package's build of the
//! controller core, and only for it.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(fleet_undo)");
    println!("cargo::rustc-cfg=fleet_undo");
}
