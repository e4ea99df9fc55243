//! Turns on the controller's mutation switches (`controller::undo`) for this package's build of its
//! library, and only for it.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(fleet_undo)");
    println!("cargo::rustc-cfg=fleet_undo");
}
