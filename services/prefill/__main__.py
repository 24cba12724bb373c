from services.prefill.service import Prefiller
from shared.service import service_main

if __name__ == "__main__":
    service_main(Prefiller, "prefill")
