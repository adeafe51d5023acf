//! Push-connector scenarios on the loopback (the list in `kvxfer_tests::scenarios::push`).

fn run(_case: &str, body: impl FnOnce(&kvxfer_tests::loopback::Loopback)) {
    body(&kvxfer_tests::loopback::Loopback);
}

kvxfer_tests::push_scenarios!(run);
