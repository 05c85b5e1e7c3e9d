fn main() {
    std::process::exit(valve_ctl::cli::run());
}
